"""Hugging Face hub ids as model paths: ``model.hf_path=Qwen/Qwen3-30B-A3B[@revision]``.

A value that is not an existing path and reads ``org/name`` or ``org/name@revision`` is resolved by
``huggingface_hub.snapshot_download`` to its snapshot directory in the hub cache (``HF_HOME`` /
``HF_HUB_CACHE``; ``HF_HUB_OFFLINE=1`` uses the cache only) and the config then holds that local
directory. The ``megarl`` commands resolve before validating and before any worker starts, in the one
process that reads the config (the driver of ``megarl train``, ``megarl convert``): every trainer rank
and engine gets the local path, so a model is looked up and downloaded once per run rather than once
per rank. On a cluster the cache must be on a filesystem every node sees (``HF_HOME`` on shared
storage), as for any model directory.
"""
from __future__ import annotations

import re
from pathlib import Path

from megarl.config.loader import ConfigError, ConfigIssue

_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")


def parse_hub_id(value: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision or None)`` when ``value`` is a hub id and not an existing path, else None.

    ``org/name`` alone could also be a relative directory: an existing one wins. Paths that start
    with ``/``, ``.`` or ``~``, and ``tiny:`` URIs, are never hub ids.
    """
    if not value or value.startswith(("/", ".", "~")) or ":" in value or Path(value).exists():
        return None
    match = _HUB_ID.match(value)
    return (match.group("repo"), match.group("revision")) if match else None


def resolve_hub_path(value: str, key: str) -> str:
    """The local directory of ``value``: itself unless it is a hub id, else its cached snapshot
    (downloaded first where the hub is reachable and ``HF_HUB_OFFLINE`` is not set).

    Args:
        value: a directory, or ``org/name[@revision]`` (revision: a branch, tag or commit hash;
            default ``main``).
        key: the config key or argument that holds it (named in errors).

    Returns:
        The directory (``.../models--org--name/snapshots/<commit>`` for a hub id).

    Raises:
        ConfigError: not in the cache while offline, an unknown repository or revision, an
            incomplete cached snapshot, or any other hub failure (names ``key``).
    """
    parsed = parse_hub_id(value)
    if parsed is None:
        return value
    repo_id, revision = parsed
    from huggingface_hub import constants, is_offline_mode, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, revision=revision)
    except IncompleteSnapshotError as e:
        raise ConfigError([ConfigIssue(key, f"the cached snapshot is incomplete: {e}", value)]) from e
    except LocalEntryNotFoundError as e:
        where = f"not a local directory, and as a hub id not in the cache {constants.HF_HUB_CACHE}"
        why = "and HF_HUB_OFFLINE is set" if is_offline_mode() else "and the hub could not be reached"
        hint = f"download it where the hub is reachable (hf download {repo_id}" + (
            f" --revision {revision})" if revision else ")") + ", or give a local directory"
        raise ConfigError([ConfigIssue(key, f"Hugging Face hub id {where} {why}: {hint}", value)]) from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError([ConfigIssue(key, f"Hugging Face hub id could not be resolved: {first}", value)]) from e


def resolve_hub_ids(cfg) -> None:
    """``model.hf_path`` / ``model.tokenizer_path`` given as hub ids (``org/name[@revision]``) become
    their cached snapshot directories, here in the one process that reads the config, so the workers
    it starts get local paths.

    Raises:
        ConfigError: a hub id that cannot be resolved (names the key).
    """
    from omegaconf import OmegaConf

    for key in ("hf_path", "tokenizer_path"):
        value = None if OmegaConf.is_missing(cfg.model, key) else cfg.model[key]
        if isinstance(value, str) and value:
            cfg.model[key] = resolve_hub_path(value, f"model.{key}")
