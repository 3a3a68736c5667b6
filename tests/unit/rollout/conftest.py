"""Fixtures for the agent-loop unit tests: the tiny model's tokenizer and a scripted engine."""
import pytest
from rollout_scripted import ScriptedEngine


@pytest.fixture(scope="session")
def tokenizer(tiny_moe_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_moe_dir)


@pytest.fixture
def scripted_engine(tokenizer):
    def make(script):
        return ScriptedEngine(tokenizer, script)
    return make
