"""megarl.weight_sync."""
