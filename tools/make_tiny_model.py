#!/usr/bin/env python3
"""Write a tiny random-init Hugging Face model (Qwen3-MoE or Qwen3 dense) with a local tokenizer.

    python tools/make_tiny_model.py OUT_DIR [--family qwen3_moe|qwen3|deepseek_v3|glm4_moe] [--seed N]
        [--chat-template tiny|qwen3|deepseek_v3|glm4_moe] [--hidden-size N] ...

``--chat-template`` other than ``tiny`` uses an official template (megarl/models/chat_templates/)
and adds its special tokens to the tokenizer.

Nothing is downloaded: the tokenizer is trained on the repository's data/gsm8k (or $MEGARL_GSM8K_DIR).
"""
import argparse
import dataclasses
import sys

from megarl.models.tiny import TinyModelSpec, make_tiny_model


def main(argv=None, prog=None) -> int:
    """The command line (``prog``: the name usage lines show, ``megarl make-tiny-model`` from megarl)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.replace("``", ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--gsm8k-dir", default=None)
    for f in dataclasses.fields(TinyModelSpec):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            parser.add_argument(flag, type=kind, default=f.default)
    args = parser.parse_args(argv)
    spec = TinyModelSpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TinyModelSpec)})
    try:
        out = make_tiny_model(args.out_dir, spec, gsm8k_dir=args.gsm8k_dir)
    except ValueError as e:  # a field out of its domain (an unknown family): one line naming it, exit 2
        parser.error(str(e))
    print(f"wrote {out} ({spec.family}, {spec.num_hidden_layers} layers, hidden {spec.hidden_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
