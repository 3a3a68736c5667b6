"""The converters' command-line arguments, defined once: ``megarl convert hf-to-megatron`` /
``megatron-to-hf``, tools/convert_hf_to_megatron.py and tools/convert_megatron_to_hf.py build their
parsers from these functions and call the converters through :func:`run_hf_to_megatron` /
:func:`run_megatron_to_hf`, so the flags and what they mean cannot drift apart.
(:mod:`megarl.conversion.dist_convert`, one rank of an externally launched job, shares
:func:`add_import_arguments`.)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""``--precision`` of both directions and the torch dtype it names."""


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    """The target layout and dtype flags of an HF -> Megatron import (Megatron's names)."""
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    parser.add_argument("--expert-model-parallel-size", type=int, default=1)
    parser.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    parser.add_argument("--precision", choices=list(PRECISION_DTYPES), default=None,
                        help="default: the HF config's dtype")


def _add_output_arguments(parser: argparse.ArgumentParser, timeout_s: float | None = 3600.0,
                          timeout_help: str = "limit for the whole conversion") -> None:
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    parser.add_argument("--timeout-s", type=float, default=timeout_s, help=timeout_help)


def add_hf_to_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    """``HF_DIR OUT_DIR`` and every flag of :func:`megarl.conversion.convert.hf_to_megatron`."""
    parser.add_argument("hf_dir", metavar="HF_DIR", help="Hugging Face model directory")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="Megatron dist checkpoint to write")
    add_import_arguments(parser)
    _add_output_arguments(parser)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: at least 1")
    return value


def add_megatron_to_hf_arguments(parser: argparse.ArgumentParser) -> None:
    """``CKPT_DIR OUT_DIR`` and every flag of :func:`megarl.conversion.convert.megatron_to_hf_dir`."""
    parser.add_argument("ckpt_dir", metavar="CKPT_DIR",
                        help="a dist checkpoint (converted, or a trainer's RUN_DIR/checkpoints/step_N)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="Hugging Face directory to write")
    parser.add_argument("--hf-config", default=None,
                        help="HF directory with config.json and tokenizer (default: CKPT_DIR's hf_config/)")
    parser.add_argument("--precision", choices=list(PRECISION_DTYPES), default=None,
                        help="default: the checkpoint's dtype (the same spelling as hf-to-megatron)")
    parser.add_argument("--dtype", choices=list(PRECISION_DTYPES.values()), default=None,
                        help="deprecated: --precision (float32 = fp32, bfloat16 = bf16, float16 = fp16)")
    parser.add_argument("--max-shard-size-gb", type=float, default=5.0, help="safetensors shard size limit")
    parser.add_argument("--ranks", type=_positive_int, default=1,
                        help="export processes on this machine, each writing its own shards of ~1/RANKS of the model")
    _add_output_arguments(parser, None, "limit for the whole export (default: sized from the checkpoint's bytes)")


def run_hf_to_megatron(args: argparse.Namespace) -> Path:
    """:func:`~megarl.conversion.convert.hf_to_megatron` with parsed arguments; returns OUT_DIR."""
    from megarl.conversion.convert import hf_to_megatron

    return hf_to_megatron(
        args.hf_dir, args.out_dir, tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, precision=args.precision,
        overwrite=args.overwrite, timeout_s=args.timeout_s)


def export_dtype(args: argparse.Namespace) -> str | None:
    """The export's torch dtype name from ``--precision`` (or the deprecated ``--dtype``, with a
    deprecation line on stderr); None: the checkpoint's."""
    if args.dtype is not None:
        spelled = {v: k for k, v in PRECISION_DTYPES.items()}[args.dtype]
        print(f"--dtype is deprecated: use --precision {spelled} (the spelling of hf-to-megatron)", file=sys.stderr)
        if args.precision is None:
            return args.dtype
    return PRECISION_DTYPES[args.precision] if args.precision else None


def run_megatron_to_hf(args: argparse.Namespace) -> Path:
    """:func:`~megarl.conversion.convert.megatron_to_hf_dir` with parsed arguments; returns OUT_DIR."""
    from megarl.conversion.convert import megatron_to_hf_dir

    return megatron_to_hf_dir(args.ckpt_dir, args.out_dir, hf_config_dir=args.hf_config, dtype=export_dtype(args),
                              max_shard_bytes=int(args.max_shard_size_gb * 2**30), overwrite=args.overwrite,
                              ranks=args.ranks, timeout_s=args.timeout_s)
