"""The retrieval corpus: one passage per line of a JSON-lines file.

Each line is ``{"id": str, "title": str, "text": str}``; ``title`` may be omitted, and
Search-R1's ``{"id", "contents"}`` lines (title on the first line of ``contents``) are read too.
A corpus is identified by the SHA-256 of its file's bytes: an index records it, and the service
refuses to serve an index built from another corpus than the one the config names.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_HASH_CHUNK_BYTES = 1 << 20


class CorpusError(ValueError):
    """A corpus line is not a passage (the message names the file and line)."""


@dataclass(frozen=True, slots=True)
class Passage:
    """One retrievable passage."""

    id: str
    title: str
    text: str

    def to_json(self) -> str:
        """One corpus line: ``{"id", "title", "text"}`` as JSON (non-ASCII kept)."""
        return json.dumps({"id": self.id, "title": self.title, "text": self.text}, ensure_ascii=False)


def parse_passage(line: str, where: str) -> Passage:
    """One corpus line -> :class:`Passage`.

    Raises:
        CorpusError: not a JSON object, or without ``id`` and ``text`` (or ``contents``).
    """
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise CorpusError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict) or "id" not in obj:
        raise CorpusError(f'{where}: expected an object with "id" and "text"')
    if "text" in obj:
        return Passage(id=str(obj["id"]), title=str(obj.get("title", "")), text=str(obj["text"]))
    if "contents" in obj:  # Search-R1's wiki-18 layout: '"Title"\ntext'
        title, _, text = str(obj["contents"]).partition("\n")
        return Passage(id=str(obj["id"]), title=title.strip('"'), text=text)
    raise CorpusError(f'{where}: passage {obj["id"]!r} has no "text" (or "contents")')


def iter_passages(path: str | Path) -> Iterator[Passage]:
    """Stream the passages of a corpus file (blank lines skipped).

    Raises:
        CorpusError: a malformed line.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield parse_passage(line, f"{path}:{lineno}")


def corpus_sha256(path: str | Path) -> str:
    """Hex SHA-256 of the corpus file's bytes."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
