"""megarl.rollout."""
