"""Known third-party console noise, filtered in one place (the driver and every Ray worker).

Two kinds, each matched precisely (message regex AND emitting module/logger), never by category
alone, so megarl's own warnings and every unknown third-party warning still reach the console:

* ``warnings.warn`` calls (``THIRD_PARTY_WARNINGS``): Megatron-Core's fallbacks when Transformer
  Engine / Apex are absent (expected on CPU and on plain-PyTorch installs) and its deprecation
  notes about settings megarl does not use.
* ``logging`` records (``THIRD_PARTY_LOG_RECORDS``): SGLang's tool-call parser complaining about
  model output (an undefined function, malformed JSON); megarl already turns a bad call into an
  observation for the policy, so these are demoted to DEBUG (shown only at ``logging.level=DEBUG``).

Besides, Hugging Face's tqdm bars (transformers' "Writing model shards" when a tiny model or an HF
export is saved, huggingface_hub's downloads) are turned off when stderr is not a terminal: in a log
file or a Slurm output they are carriage-return debris (`quiet_progress_bars`).

`install` is idempotent; the driver calls it at start and Ray runs it in every worker process
through the job's ``worker_process_setup_hook`` (`ray_setup_hook`).
"""
from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

THIRD_PARTY_WARNINGS: tuple[tuple[str, str], ...] = (
    # (message regex, module regex): module is the warning's caller module (warnings' ``module``).
    (r"(Transformer Engine and )?Apex (is|are) not installed", r"(megatron|megatron_fsdp)\."),
    (r".*full scope is deprecated", r"megatron\."),
    (r".*is deprecated and (will be|is) ignored", r"megatron\."),
    # Megatron's optimizer probes ``param.main_grad``-style attributes on non-leaf tensors.
    (r"The \.grad attribute of a Tensor that is not a leaf Tensor", r"megatron\.core\.optimizer"),
    # torch's own collectives deprecating each other (called by Megatron's gathers).
    (r"`torch\.distributed\.\w+` is deprecated", r"torch\.distributed"),
)
"""``warnings`` filters: (message regex matched at the message start, module regex)."""

THIRD_PARTY_LOG_RECORDS: tuple[tuple[str, str], ...] = (
    # (logger name prefix, message regex searched anywhere)
    ("sglang.srt.function_call", r"undefined function|Error in pars|JSON|json|decode|Failed to parse"),
)
"""``logging`` records demoted to DEBUG: (package whose module loggers are filtered, message regex).
A logger's filters do not apply to its children's records, so the filter goes on the logger of
every module of the package (found on disk, nothing imported)."""

RAY_SETUP_HOOK = "megarl.logging_setup.ray_setup_hook"
"""Ray ``runtime_env["worker_process_setup_hook"]``: runs `install` in each worker at start."""


class _Demote(logging.Filter):
    """Turns a matching record into DEBUG and lets it through only if its logger allows DEBUG."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG and self.pattern.search(record.getMessage()):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


_installed = False


def install() -> None:
    """Install the filters in this process (idempotent)."""
    global _installed
    if _installed:
        return
    for message, module in THIRD_PARTY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module)
    for package, pattern in THIRD_PARTY_LOG_RECORDS:
        demote = _Demote(pattern)
        for name in _module_names(package):
            logging.getLogger(name).addFilter(demote)
    quiet_progress_bars()
    _installed = True


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def quiet_progress_bars(stream: Any = None) -> bool:
    """Turn off Hugging Face's progress bars in this process when ``stream`` is not a terminal.

    ``huggingface_hub.utils.disable_progress_bars()`` switches off the hub's bars, and transformers
    (5.x) starts with its own bars off when the hub's are off at its import
    (``transformers.utils.logging._tqdm_active``); if transformers is already imported, its
    ``disable_progress_bar()`` switches them off now. A user's ``HF_HUB_DISABLE_PROGRESS_BARS``
    (either value) is left to decide.

    Args:
        stream: where the bars would be drawn (default ``sys.stderr``, tqdm's stream).

    Returns:
        Whether the bars were turned off.
    """
    if _is_terminal(sys.stderr if stream is None else stream) or "HF_HUB_DISABLE_PROGRESS_BARS" in os.environ:
        return False
    try:
        from huggingface_hub.utils import disable_progress_bars
    except ImportError:  # no Hugging Face stack, no bars
        return False
    disable_progress_bars()
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        hf_logging.disable_progress_bar()
    return True


def _module_names(package: str) -> list[str]:
    """``package`` and its direct submodules' names (from the files on disk, nothing imported; [] if
    not installed)."""
    import importlib.util

    top, *rest = package.split(".")
    spec = importlib.util.find_spec(top)  # a top-level spec imports nothing
    if spec is None or not spec.submodule_search_locations:
        return []
    folders = [Path(loc, *rest) for loc in spec.submodule_search_locations]
    return [package] + sorted(f"{package}.{f.stem}" for d in folders for f in d.glob("*.py") if f.stem != "__init__")


def link_ray_logs(run_dir: Any) -> Path | None:
    """Make ``run_dir/ray_logs`` a link to this Ray session's log folder (every worker's stdout and
    stderr, the raylet's and GCS's logs). Ray keeps its session under its temp dir (a short path:
    its Unix socket paths must stay under 108 bytes, so ``run_dir`` cannot host it); the link
    makes the logs findable from the run. Returns the link, or None when this process is not a Ray
    driver of a local node (``ray.init(address=...)`` of a remote cluster keeps them on the head).
    """
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    logs = node.get_logs_dir_path() if node is not None else None
    if not logs or not Path(logs).is_dir():
        return None
    link = Path(run_dir) / "ray_logs"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(logs, target_is_directory=True)
    return link


def ray_setup_hook() -> None:
    """Ray's worker setup hook (`RAY_SETUP_HOOK`)."""
    install()
