"""megarl.launch."""
