#!/usr/bin/env python3
"""Convert a Hugging Face model directory into a Megatron-Core dist checkpoint.

    python tools/convert_hf_to_megatron.py HF_DIR OUT_DIR --tensor-model-parallel-size 2 \\
        [--pipeline-model-parallel-size N] [--expert-model-parallel-size N] \\
        [--expert-tensor-parallel-size N] [--virtual-pipeline-model-parallel-size N]

Spawns one CPU (gloo) process per rank of the layout, streams the weights group by group, and
writes OUT_DIR atomically (a temporary sibling renamed at the end). The HF config, generation
config and tokenizer are kept in OUT_DIR/hf_config for the export. The same command as
``megarl convert hf-to-megatron`` (flags from megarl.conversion.convert_cli).
"""
import argparse
import os
import sys

from megarl.conversion.convert_cli import add_hf_to_megatron_arguments, run_hf_to_megatron


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.replace("``", ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_hf_to_megatron_arguments(parser)
    return parser


def main(argv=None) -> int:
    from megarl.cli import report_expected_errors

    args = build_parser().parse_args(argv)

    def run() -> int:
        print(f"wrote {run_hf_to_megatron(args)}")
        return 0

    # an expected error (a missing path, an existing OUT_DIR, a damaged checkpoint) is one line, exit 2
    return report_expected_errors(os.path.basename(__file__), run,
                                  debug=os.environ.get("MEGARL_DEBUG", "") not in ("", "0"))


if __name__ == "__main__":
    sys.exit(main())
