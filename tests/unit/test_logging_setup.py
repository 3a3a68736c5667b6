"""megarl.logging_setup: the known third-party warnings are dropped (by message and module),
megarl's own and unknown ones are not; SGLang's tool-call parser complaints are demoted; Hugging
Face's progress bars are off when stderr is not a terminal and stay on a terminal."""
import fcntl
import io
import logging
import os
import pty
import struct
import subprocess
import sys
import termios
import warnings
from pathlib import Path

import pytest

from megarl import logging_setup

REPO = Path(__file__).resolve().parents[2]


def _warn_from(module: str, message: str) -> list:
    """Emit ``message`` as if from ``module`` with megarl's filters installed; the recorded ones."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logging_setup._installed = False
        logging_setup.install()
        warnings.warn_explicit(message, UserWarning, "x.py", 1, module=module, registry={})
    return [str(w.message) for w in caught]


def test_megatron_fallbacks_are_dropped():
    assert _warn_from("megatron.core.models.backends", "Apex is not installed. Falling back to Torch Norm") == []
    assert _warn_from("megatron.core.optimizer", "Transformer Engine and Apex are not installed. Falling back "
                      "to Torch optimizers.") == []
    assert _warn_from("megatron.core.transformer.transformer_config", "full scope is deprecated. Use empty "
                      "cuda_graph_scope to capture the whole layer.") == []


def test_same_message_elsewhere_and_megarl_warnings_are_kept():
    assert _warn_from("megarl.launch.driver", "Apex is not installed. Falling back to Torch Norm")
    assert _warn_from("megatron.core.optimizer", "something megatron has never said")
    assert _warn_from("megarl.rollout.agent", "full scope is deprecated")


def test_sglang_tool_call_parser_complaints_are_demoted(caplog):
    logging_setup._installed = False
    logging_setup.install()
    log = logging.getLogger("sglang.srt.function_call.qwen25_detector")
    with caplog.at_level(logging.INFO):
        log.warning("Failed to parse JSON part: {\"code\"}, JSON parse error: Expecting ':' delimiter")
        log.warning("an unrelated sglang warning")
        logging.getLogger("megarl.rollout.agent").warning("Failed to parse JSON part")
    assert [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING] == [
        ("sglang.srt.function_call.qwen25_detector", "an unrelated sglang warning"),
        ("megarl.rollout.agent", "Failed to parse JSON part")]


def test_module_names_found_on_disk():
    names = logging_setup._module_names("sglang.srt.function_call")
    assert "sglang.srt.function_call.qwen25_detector" in names
    assert logging_setup._module_names("no_such_package_xyz") == []


# A tiny model saved as `megarl validate` saves one (transformers' "Writing model shards" bar).
_SAVE = """
import sys, tempfile
from megarl import logging_setup
logging_setup.install()  # as megarl's CLI, before transformers is imported
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging
model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2))
with tempfile.TemporaryDirectory() as d:
    model.save_pretrained(d)
    print("MARK", file=sys.stderr, flush=True)
    hf_logging.enable_progress_bar()  # the reference: the same save with the bars on
    model.save_pretrained(d)
"""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.timeout(240)
def test_hf_progress_bars_are_off_when_stderr_is_not_a_terminal():
    proc = subprocess.run([sys.executable, "-c", _SAVE], capture_output=True, text=True, env=_env(), timeout=200)
    assert proc.returncode == 0, proc.stderr
    quiet, reference = proc.stderr.split("MARK")
    assert "Writing model shards" not in quiet
    assert "Writing model shards" in reference  # the save does draw the bar when bars are on


@pytest.mark.timeout(240)
def test_hf_progress_bars_stay_on_a_terminal():
    master, slave = pty.openpty()
    # 24 x 120: a fresh pty is 0 columns wide, where tqdm draws an empty line.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-c", _SAVE], stdout=subprocess.DEVNULL, stderr=slave, env=_env())
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=200) == 0
    quiet, _ = b"".join(chunks).decode("utf-8", "replace").split("MARK")
    assert "Writing model shards" in quiet


def test_bars_of_an_already_imported_transformers_are_turned_off(monkeypatch):
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as hf_logging

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    was_on = hf_logging.is_progress_bar_enabled()
    try:
        hf_logging.enable_progress_bar()
        with open(os.devnull, "w") as not_a_terminal:
            assert logging_setup.quiet_progress_bars(stream=not_a_terminal)
        assert not hf_logging.is_progress_bar_enabled() and are_progress_bars_disabled()
        assert isinstance(hf_logging.tqdm(range(2), desc="Writing model shards"), hf_logging.EmptyTqdm)
        hf_logging.enable_progress_bar()
        master, slave = pty.openpty()
        with os.fdopen(slave, "w") as terminal:
            assert not logging_setup.quiet_progress_bars(stream=terminal)
        os.close(master)
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")  # the user's own setting decides
        assert not logging_setup.quiet_progress_bars(stream=io.StringIO())
        assert hf_logging.is_progress_bar_enabled()
    finally:
        (hf_logging.enable_progress_bar if was_on else hf_logging.disable_progress_bar)()
