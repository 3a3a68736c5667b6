"""The model directory an SGLang engine serves: the checkpoint itself, or an untied view of it.

SGLang 0.5.23's ``Qwen3MoeForCausalLM`` and ``Glm4MoeForCausalLM`` (``srt/models/qwen3_moe.py``,
``glm4_moe.py``) build ``lm_head`` as a ``ParallelLMHead`` of its own whatever
``tie_word_embeddings`` says (neither file reads the field; ``qwen3.py`` and ``deepseek_v2.py`` do,
and share ``embed_tokens`` then), and their ``load_weights`` fills it only from a tensor named
``lm_head.weight``. A tied checkpoint has none: served as it is, the engine samples from an output
layer that nothing loaded.

Such a checkpoint is served through an *untied view*, written once per node and cached: a directory
holding a copy of ``config.json`` with ``tie_word_embeddings: false``, one more safetensors file
with ``lm_head.weight`` (= ``model.embed_tokens.weight``), an index naming every tensor's file, and
symbolic links to everything else (weights, tokenizer; a lone ``model.safetensors`` linked as
:data:`SINGLE_FILE`, since transformers would read it and ignore the index). SGLang and transformers
load the view as the same model, untied. The trainer stays tied, as the checkpoint
says; every weight sync sends the trained embedding under both names
(``megarl.weight_sync.model_specs.engine_table``), so the engine's untied ``lm_head`` stays equal to it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megarl.models.families import find_family

EMBEDDING = "model.embed_tokens.weight"
OUTPUT_LAYER = "lm_head.weight"
OUTPUT_LAYER_FILE = "lm_head.safetensors"
"""The view's extra weight file (holds only :data:`OUTPUT_LAYER`)."""
INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model-00001.safetensors"
"""A single-file checkpoint's ``model.safetensors`` in the view (beside :data:`OUTPUT_LAYER_FILE`, under the index)."""


def _field(config: Any, name: str, default: Any) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def needs_untied_view(config: Any) -> bool:
    """A tied checkpoint whose SGLang class keeps its own ``lm_head`` (module docstring; the family's
    :attr:`~megarl.models.families.Family.engine_unties_lm_head`).

    Args:
        config: ``config.json`` as a dict, or a ``transformers`` config. A missing
            ``tie_word_embeddings`` counts as false (both families' ``transformers`` default).
    """
    family = find_family(_field(config, "model_type", None))
    return family is not None and family.engine_unties_lm_head and bool(
        _field(config, "tie_word_embeddings", False))


def cache_root() -> Path:
    """``$MEGARL_CACHE_DIR`` (default ``~/.cache/megarl``), as for the ``tiny:`` models."""
    return Path(os.environ.get("MEGARL_CACHE_DIR", Path.home() / ".cache" / "megarl"))


def _view_key(src: Path) -> str:
    """Changes when the checkpoint does: its path, its config and its weight files' sizes and times."""
    digest = hashlib.sha256(str(src).encode())
    digest.update((src / "config.json").read_bytes())
    for path in sorted(src.glob("*.safetensors")):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def _embedding_file(src: Path) -> Path:
    """The safetensors file of ``src`` holding :data:`EMBEDDING`.

    Raises:
        FileNotFoundError: no file holds it.
    """
    if (src / INDEX).is_file():
        name = json.loads((src / INDEX).read_text())["weight_map"].get(EMBEDDING)
        if name:
            return src / name
    from safetensors import safe_open

    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            if EMBEDDING in fh.keys():
                return path
    raise FileNotFoundError(f"{src}: no safetensors file holds {EMBEDDING}")


def has_output_layer(src: Path) -> bool:
    """``src`` already carries :data:`OUTPUT_LAYER` (some tied checkpoints save both tensors); the
    index says so when there is one, else each file's header is read."""
    from safetensors import safe_open

    if (Path(src) / INDEX).is_file():
        return OUTPUT_LAYER in json.loads((Path(src) / INDEX).read_text())["weight_map"]
    for path in sorted(Path(src).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            if OUTPUT_LAYER in fh.keys():
                return True
    return False


def write_untied_view(src: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the untied view of the checkpoint ``src`` into the new directory ``out`` (module docstring).

    Raises:
        FileNotFoundError: ``src`` has no ``config.json`` or no embedding.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(src).resolve(), Path(out)
    out.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if has_output_layer(src):  # nothing to add: SGLang loads the checkpoint's own lm_head.weight
        for entry in sorted(src.iterdir()):
            if entry.name != "config.json":
                (out / entry.name).symlink_to(entry)
        return out
    indexed = (src / INDEX).is_file()
    for entry in sorted(src.iterdir()):  # transformers prefers a model.safetensors to any index: renamed
        name = SINGLE_FILE if entry.name == "model.safetensors" and not indexed else entry.name
        if entry.name not in ("config.json", INDEX):
            (out / name).symlink_to(entry)
    with safe_open(str(_embedding_file(src)), framework="pt") as fh:
        embedding = fh.get_tensor(EMBEDDING)
    save_file({OUTPUT_LAYER: embedding.contiguous()}, str(out / OUTPUT_LAYER_FILE), metadata={"format": "pt"})
    # An index naming both files: SGLang loads only the files an index names, transformers reads a
    # second file only through one.
    index = json.loads((src / INDEX).read_text()) if indexed else {"metadata": {}, "weight_map": {}}
    if not indexed:
        for path in sorted(out.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as fh:
                index["weight_map"].update(dict.fromkeys(fh.keys(), path.name))
    index["weight_map"][OUTPUT_LAYER] = OUTPUT_LAYER_FILE
    (out / INDEX).write_text(json.dumps(index, indent=2))
    return out


def served_model_dir(model_dir: str | os.PathLike, *, root: str | os.PathLike | None = None) -> str:
    """The directory an engine must load for ``model_dir``: ``model_dir`` itself, or its untied view.

    The view is built once per node (per checkpoint version) under ``root`` (default
    ``$MEGARL_CACHE_DIR/untied``) and reused by every engine and restart there: written into a temporary
    directory and renamed into place, so engines preparing it at once keep whichever finished first.
    Anything that is not a checkpoint directory (no ``config.json``) passes through unchanged.
    """
    src = Path(model_dir)
    if not (src / "config.json").is_file():
        return str(model_dir)
    if not needs_untied_view(json.loads((src / "config.json").read_text())):
        return str(model_dir)
    return cached_view(src, Path(root) if root is not None else cache_root() / "untied", write_untied_view)


def cached_view(src: Path, base: Path, write: Callable[[Path, Path], Path]) -> str:
    """``base/<name>-<key>``: a view of the checkpoint ``src`` written by ``write(src, out)`` once per
    checkpoint version (:func:`_view_key`), into a temporary directory renamed into place, so engines
    preparing it at once keep whichever finished first."""
    src = src.resolve()
    out = base / f"{src.name}-{_view_key(src)}"
    if (out / "config.json").is_file():
        return str(out)
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=base))
    try:
        write(src, tmp / "view")
        try:
            (tmp / "view").rename(out)
        except OSError:  # another engine on this node finished first: keep its view
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)
