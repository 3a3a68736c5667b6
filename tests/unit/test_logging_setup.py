"""megarl.logging_setup: the known third-party warnings are dropped (by message and module),
megarl's own and unknown ones are not; SGLang's tool-call parser complaints are demoted."""
import logging
import warnings

from megarl import logging_setup


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
