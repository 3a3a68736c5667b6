"""The commands that build the paths a shipped example's recipe names (its model, its data).

Each example owns a manifest, ``examples/<name>/builds.txt`` (YAML; not ``.yaml``, so that nothing
that collects the examples' recipes by ``examples/*/*.yaml`` takes it for one), mapping a path its
scripts write (relative to the repository root, where the commands run) to the command that writes it::

    runs/arithmetic_demo/model: python examples/arithmetic_tool/make_model.py runs/arithmetic_demo/model

``megarl validate`` adds the command to the error of a missing path the manifest covers (the path
itself or a file under it), so a recipe run before its ``make_model.py`` says how to build the model.
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
"""Where the manifests are read: the repository's examples (absent in an installed wheel: no hints)."""


def read_manifests(examples_dir: Path = EXAMPLES_DIR) -> dict[str, tuple[str, Path]]:
    """Every ``examples/*/builds.txt`` entry.

    Args:
        examples_dir: the directory holding one folder per example.

    Returns:
        Built path (as written in the manifest) -> (command, manifest file); empty when there is none.

    Raises:
        ValueError: a manifest that is not a mapping of path to command string (names the file).
    """
    out: dict[str, tuple[str, Path]] = {}
    for manifest in sorted(examples_dir.glob("*/builds.txt")):
        data = yaml.safe_load(manifest.read_text(encoding="utf-8")) or {}
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ValueError(f"{manifest}: must map each built path to the command that builds it")
        out.update({str(path): (command, manifest) for path, command in data.items()})
    return out


def _covers(built: str, path: str, repo: Path) -> bool:
    """True when ``path`` (as a config names it, relative to the working directory) is ``built`` or under it."""
    as_written = os.path.normpath(path)
    if as_written == os.path.normpath(built) or as_written.startswith(os.path.normpath(built) + os.sep):
        return True
    return Path(path).resolve().is_relative_to((repo / built).resolve())


def build_hint(path: str, examples_dir: Path = EXAMPLES_DIR) -> str:
    """What to append to a missing path's error: the command an example's manifest gives for it.

    Args:
        path: the missing path, as the config names it.
        examples_dir: where the manifests are (:func:`read_manifests`).

    Returns:
        ``"; build it first (from the repository root): COMMAND (MANIFEST)"``, or ``""`` when no
        manifest covers ``path`` or a manifest cannot be read.
    """
    try:
        manifests = read_manifests(examples_dir)
    except (OSError, ValueError, yaml.YAMLError):
        return ""  # a broken manifest must not hide the real error; tests read every manifest
    for built, (command, manifest) in manifests.items():
        if _covers(built, path, examples_dir.parent):
            where = manifest.relative_to(examples_dir.parent)
            return f"; build it first (from the repository root): {command} ({where})"
    return ""
