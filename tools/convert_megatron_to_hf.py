#!/usr/bin/env python3
"""Export a Megatron-Core dist checkpoint (model weights, any parallel layout) to Hugging Face.

    python tools/convert_megatron_to_hf.py CKPT_DIR OUT_DIR [--hf-config HF_DIR] [--dtype bfloat16]

Writes safetensors shards (+ index), config.json, generation_config.json and tokenizer files from
HF_DIR (default: CKPT_DIR/hf_config, which tools/convert_hf_to_megatron.py stores). The config is
checked against the checkpoint's tensor shapes (and against CKPT_DIR/hf_config when both exist).
OUT_DIR is written atomically.
"""
import argparse
import sys

from megarl.checkpoint.convert import megatron_to_hf_dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--hf-config", default=None, help="HF directory with config.json and tokenizer")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default: the checkpoint's dtype")
    parser.add_argument("--max-shard-size-gb", type=float, default=5.0)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out = megatron_to_hf_dir(args.ckpt_dir, args.out_dir, hf_config_dir=args.hf_config, dtype=args.dtype,
                             max_shard_bytes=int(args.max_shard_size_gb * 2**30), overwrite=args.overwrite,
                             timeout_s=args.timeout_s)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
