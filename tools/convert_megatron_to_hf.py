#!/usr/bin/env python3
"""Export a Megatron-Core dist checkpoint (model weights, any parallel layout) to Hugging Face.

    python tools/convert_megatron_to_hf.py CKPT_DIR OUT_DIR [--hf-config HF_DIR] [--precision bf16]

CKPT_DIR: a converted checkpoint or a trainer's RUN_DIR/checkpoints/step_N. Writes safetensors
shards (+ index), config.json, generation_config.json and tokenizer files from HF_DIR (default:
CKPT_DIR's hf_config/, which both the converter and the trainer store). The config is checked
against the checkpoint's tensor shapes (and against the stored one when both exist). OUT_DIR is
written atomically. The same command as ``megarl convert megatron-to-hf`` (flags from
megarl.conversion.convert_cli).
"""
import argparse
import os
import sys

from megarl.conversion.convert_cli import add_megatron_to_hf_arguments, run_megatron_to_hf


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.replace("``", ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_megatron_to_hf_arguments(parser)
    return parser


def main(argv=None) -> int:
    from megarl.cli import report_expected_errors

    args = build_parser().parse_args(argv)

    def run() -> int:
        print(f"wrote {run_megatron_to_hf(args)}")
        return 0

    # an expected error (a missing path, an existing OUT_DIR, a damaged checkpoint) is one line, exit 2
    return report_expected_errors(os.path.basename(__file__), run,
                                  debug=os.environ.get("MEGARL_DEBUG", "") not in ("", "0"))


if __name__ == "__main__":
    sys.exit(main())
