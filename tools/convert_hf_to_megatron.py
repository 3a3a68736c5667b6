#!/usr/bin/env python3
"""Convert a Hugging Face model directory into a Megatron-Core dist checkpoint.

    python tools/convert_hf_to_megatron.py HF_DIR OUT_DIR --tensor-model-parallel-size 2 \\
        [--pipeline-model-parallel-size N] [--expert-model-parallel-size N] \\
        [--expert-tensor-parallel-size N] [--virtual-pipeline-model-parallel-size N]

Spawns one CPU (gloo) process per rank of the layout, streams the weights group by group, and
writes OUT_DIR atomically (a temporary sibling renamed at the end). The HF config, generation
config and tokenizer are kept in OUT_DIR/hf_config for the export.
"""
import argparse
import sys

from megarl.checkpoint.convert import hf_to_megatron
from megarl.checkpoint.dist_convert import add_import_arguments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir")
    parser.add_argument("out_dir")
    add_import_arguments(parser)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out = hf_to_megatron(
        args.hf_dir, args.out_dir, tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, precision=args.precision,
        overwrite=args.overwrite, timeout_s=args.timeout_s)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
