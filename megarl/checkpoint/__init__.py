"""megarl.checkpoint."""
