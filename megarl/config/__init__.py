"""megarl.config."""
