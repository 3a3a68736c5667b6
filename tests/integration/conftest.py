"""Real SGLang CPU servers for the integration tests (rollout, weight sync, ...), shared across the
whole session. (Moved up from ``tests/integration/rollout/conftest.py`` so that every integration
directory uses the same servers: a session fixture defined in two conftest files starts twice.)

An SGLang server on this CPU setup takes ~20 s to start and ~2.4 GB of memory, so tests share:

- ``sglang_engine`` (session): one server on the tiny Qwen3-MoE model, fp32, routed-expert capture
  on, xgrammar for regex / json_schema constrained decoding. Any rollout test may use it; a test
  that pauses it, changes its weights or flushes its cache must restore it before returning
  (resume, reload ``tiny_moe_dir``).
- ``second_sglang_engine`` (session): a second server on the same model, for router tests (affinity,
  killing an engine). ``two_sglang_engines`` (function) returns both, restarting any that a
  previous test killed.
"""
from __future__ import annotations

import importlib.util

import pytest

from megarl.rollout.engine_process import EngineProcess

ENGINE_STARTUP_TIMEOUT_S = 240.0
ENGINE_KWARGS = dict(
    device="cpu",
    dtype="float32",  # the trainer compares logprobs in fp32
    mem_fraction_static=0.05,
    max_total_tokens=32768,  # KV cache of the tiny model: 512 bytes per token
    grammar_backend="xgrammar",
    enable_return_routed_experts=True,
    env={"OMP_NUM_THREADS": "1"},
)


def _custom_weight_loaders() -> list[str]:
    # The weight-sync package registers its loader here once it exists; SGLang imports a custom
    # loader only when a request names it, so listing it costs nothing at start-up.
    if importlib.util.find_spec("megarl.weight_sync.sglang_loader") is None:
        return []
    from megarl.weight_sync import sglang_loader

    return list(getattr(sglang_loader, "CUSTOM_WEIGHT_LOADERS", []))


def _start_engine(model_dir, log_path, engine_id: str) -> EngineProcess:
    engine = EngineProcess(model_dir, log_path=log_path, engine_id=engine_id,
                           custom_weight_loaders=_custom_weight_loaders(), **ENGINE_KWARGS)
    return engine.start()


def ensure_running(engine: EngineProcess) -> EngineProcess:
    """Restart a session engine a previous test killed."""
    if not (engine.is_alive() and engine.health()):
        engine.restart(ENGINE_STARTUP_TIMEOUT_S)
    return engine


@pytest.fixture(scope="session")
def _sglang_engines_started(tiny_moe_dir, tmp_path_factory):
    """Session registry of the servers; each starts on first use (the second only if asked)."""
    log_dir = tmp_path_factory.mktemp("sglang_logs")
    started: dict[str, EngineProcess] = {}
    try:
        yield started, tiny_moe_dir, log_dir
    finally:
        for engine in started.values():
            engine.stop(grace_s=0)  # a graceful drain costs ~5 s per server and proves nothing here


@pytest.fixture(scope="session")
def sglang_engine(_sglang_engines_started) -> EngineProcess:
    """The shared SGLang CPU server (an :class:`EngineProcess`; ``.url``, ``.model_path``)."""
    started, model_dir, log_dir = _sglang_engines_started
    if "engine0" not in started:
        started["engine0"] = _start_engine(model_dir, log_dir / "engine0.log", "engine0")
    engine = started["engine0"]
    engine.wait_healthy(ENGINE_STARTUP_TIMEOUT_S)
    return engine


@pytest.fixture(scope="session")
def second_sglang_engine(_sglang_engines_started, sglang_engine) -> EngineProcess:
    """A second server for router tests; may have been killed and restarted by a test."""
    started, model_dir, log_dir = _sglang_engines_started
    if "engine1" not in started:
        started["engine1"] = _start_engine(model_dir, log_dir / "engine1.log", "engine1")
    return ensure_running(started["engine1"].wait_healthy(ENGINE_STARTUP_TIMEOUT_S))


@pytest.fixture
def two_sglang_engines(sglang_engine, second_sglang_engine) -> list[EngineProcess]:
    """Both servers, running (a killed one is restarted first)."""
    return [ensure_running(sglang_engine), ensure_running(second_sglang_engine)]


@pytest.fixture
def sglang_url(sglang_engine) -> str:
    """URL of the shared SGLang CPU server."""
    return sglang_engine.url


@pytest.fixture(scope="session")
def tiny_moe_hf(tiny_moe_dir):
    """The tiny model in transformers (fp32, eval) and its tokenizer: the logprob reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_moe_dir)
