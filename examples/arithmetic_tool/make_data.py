#!/usr/bin/env python3
"""Write the arithmetic task's prompts: ``data/train.jsonl`` and a disjoint held-out ``data/test.jsonl``.

    python examples/arithmetic_tool/make_data.py [--out-dir DIR] [--num-train N] [--num-test N] [--seed S]

Rows: ``{"question": 'What is "48 + 73"?', "answer": "121", "expression": "48 + 73"}`` (made by
task.py here). The committed files were written with the defaults.
"""
import argparse
from pathlib import Path

from megarl.data.datasets import write_jsonl
from megarl.plugins import import_module

# task.py is a plugin file, not a package module: imported the way megarl imports it.
task = import_module(str(Path(__file__).resolve().with_name("task.py")), "make_data.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "data"))
    parser.add_argument("--num-train", type=int, default=4000)
    parser.add_argument("--num-test", type=int, default=200)
    parser.add_argument("--min-digits", type=int, default=2)
    parser.add_argument("--max-digits", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = task.make_arithmetic_rows(args.num_train + args.num_test, seed=args.seed,
                                     min_digits=args.min_digits, max_digits=args.max_digits)
    train, test = task.split_disjoint(rows, args.num_test)
    out = Path(args.out_dir)
    print(write_jsonl(out / "train.jsonl", train), len(train))
    print(write_jsonl(out / "test.jsonl", test), len(test))


if __name__ == "__main__":
    main()
