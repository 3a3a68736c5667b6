"""megarl.data."""
