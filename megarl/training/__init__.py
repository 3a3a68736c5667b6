"""megarl.training."""
