"""The SGLang server fixtures of the rollout tests live in ``tests/integration/conftest.py`` (shared
with the other integration directories, so that one session starts each server once)."""
