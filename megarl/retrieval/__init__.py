"""Retrieval for search agents (Search-R1 style): a passage index and the HTTP service over it.

- :mod:`~megarl.retrieval.corpus`: the corpus format (JSON lines ``{"id", "title", "text"}``), read
  streaming, with the SHA-256 of its bytes (the identity an index records).
- :mod:`~megarl.retrieval.index`: ``megarl index build CORPUS OUT`` (BM25 with ``bm25s``, or dense
  with ``faiss`` over ``all-MiniLM-L6-v2`` embeddings) and :class:`~megarl.retrieval.index.Retriever`.
- :mod:`~megarl.retrieval.server`: the service process (``POST /retrieve`` with a batch of queries,
  concurrent requests coalesced into one library call).
- :mod:`~megarl.retrieval.service`: starting, checking and stopping that process from the launcher.

The rollout side only speaks HTTP to the service (the ``search`` tool), so this package's heavy
imports (bm25s, faiss, sentence-transformers) happen in the service process only.
"""
