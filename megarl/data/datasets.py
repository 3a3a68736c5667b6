"""Prompt datasets: rows of a JSON-lines or Parquet file, checked once when loaded.

A row is a plain ``dict`` (the dataset's columns). The rollout side renders ``row[prompt_key]``
with the chat template and hands the whole row to the reward function, so any extra column (a
reference answer, a test case, a difficulty) travels with the prompt untouched.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.registry import Registry

Row = dict[str, Any]


class DatasetError(ValueError):
    """A dataset file is missing, unreadable, or a row lacks a required field."""


def read_rows(path: str | os.PathLike) -> list[Row]:
    """Read every row of a ``.jsonl`` (``.json`` lines) or ``.parquet`` file.

    Args:
        path: the file. The format is chosen by the suffix: ``.jsonl``/``.json``/``.jsonl.gz`` are
            JSON lines (one object per non-empty line), ``.parquet`` needs ``pyarrow``.

    Returns:
        The rows, in file order.

    Raises:
        DatasetError: the file does not exist, a line is not a JSON object (the error names the
            line number), the suffix is unknown, or ``pyarrow`` is missing for Parquet.
    """
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset file not found: {p}")
    name = p.name.lower()
    if name.endswith(".parquet"):
        return _read_parquet(p)
    if name.endswith((".jsonl", ".json", ".jsonl.gz")):
        return _read_jsonl(p)
    raise DatasetError(f"{p}: unknown dataset format (use .jsonl or .parquet)")


def _read_jsonl(p: Path) -> list[Row]:
    import gzip

    opener = gzip.open if p.name.lower().endswith(".gz") else open
    rows: list[Row] = []
    with opener(p, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{p}:{lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(row, dict):
                raise DatasetError(f"{p}:{lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _read_parquet(p: Path) -> list[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise DatasetError(f"{p}: reading Parquet needs pyarrow (pip install pyarrow)") from e
    return pq.read_table(p).to_pylist()


DatasetReader = Callable[..., Sequence[Row]]
DATASET_REGISTRY: Registry[DatasetReader] = Registry("dataset", "data.dataset", [("file", read_rows)])
"""``data.dataset`` -> reader ``(path, **data.dataset_kwargs) -> rows``; ``file`` reads jsonl / parquet."""


def register_dataset(name: str) -> Callable[[DatasetReader], DatasetReader]:
    """Decorator adding a dataset reader ``(path, **kwargs) -> list of row dicts`` to
    :data:`DATASET_REGISTRY` (``path`` is ``data.train_path`` or ``data.eval_path``, verbatim).

    Raises:
        ValueError: ``name`` is already registered to another reader.
    """
    return DATASET_REGISTRY.register(name)


def load_rows(dataset: str, path: str, **kwargs: Any) -> list[Row]:
    """The rows ``data.dataset`` (registry name or import path) reads from ``path``.

    Raises:
        DatasetError: the reader failed or did not return rows (the message names ``data.dataset``).
        megarl.plugins.PluginError: unknown name or unloadable import path.
    """
    reader = DATASET_REGISTRY.resolve(dataset)
    if reader is read_rows and not kwargs:
        return read_rows(path)
    try:
        rows = list(reader(path, **kwargs))
    except DatasetError:
        raise
    except Exception as e:  # the user's reader; reported with its key
        raise DatasetError(f"data.dataset={dataset!r} failed on {path}: {type(e).__name__}: {e}") from e
    if not all(isinstance(row, dict) for row in rows):
        raise DatasetError(f"data.dataset={dataset!r} must return dict rows (got "
                           f"{type(next(r for r in rows if not isinstance(r, dict))).__name__})")
    return rows


def write_jsonl(path: str | os.PathLike, rows: Sequence[Row]) -> Path:
    """Write rows as JSON lines (parents created). Returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return p


@dataclass
class PromptDataset:
    """Prompts for RL: rows with a prompt field and a reference-answer field.

    Attributes:
        rows: the dataset rows (column name -> value).
        prompt_key: the column holding the prompt text.
        answer_key: the column holding the reference answer given to the reward function.
        path: where the rows came from (for error messages).
    """

    rows: list[Row]
    prompt_key: str = "question"
    answer_key: str = "answer"
    path: str = "<memory>"

    def __post_init__(self) -> None:
        if not self.rows:
            raise DatasetError(f"{self.path}: the dataset is empty")
        for i, row in enumerate(self.rows):
            for key, field_name in ((self.prompt_key, "data.prompt_key"), (self.answer_key, "data.answer_key")):
                if key not in row:
                    raise DatasetError(
                        f"{self.path}: row {i} has no field {key!r} ({field_name}); "
                        f"its fields are {sorted(row)}")
            if not isinstance(self.rows[i][self.prompt_key], str):
                raise DatasetError(f"{self.path}: row {i} field {self.prompt_key!r} is not a string")

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, prompt_key: str = "question",
                  answer_key: str = "answer", max_rows: int | None = None, dataset: str = "file",
                  dataset_kwargs: dict[str, Any] | None = None) -> PromptDataset:
        """Load a dataset file (see :func:`read_rows`) or the rows a ``dataset`` reader returns for
        ``path`` (see :func:`load_rows`), keeping at most ``max_rows`` rows.

        Raises:
            DatasetError: unreadable file, empty dataset, or a row without the prompt/answer field.
        """
        rows = load_rows(dataset, str(path), **dict(dataset_kwargs or {}))
        if max_rows is not None:
            rows = rows[:max_rows]
        return cls(rows, prompt_key=prompt_key, answer_key=answer_key, path=str(path))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Row:
        return self.rows[index]

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    def prompt(self, index: int) -> str:
        """The prompt text of row ``index``."""
        return self.rows[index][self.prompt_key]
