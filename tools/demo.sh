#!/usr/bin/env bash
# Install megarl (tools/install.sh) and run the main job on its embedded default: GSPO on GSM8K with a
# tiny Qwen3-MoE on CPU (Megatron-Core over gloo, a real SGLang CPU server, weight sync every step).
# Extra arguments are config overrides, e.g. `bash tools/demo.sh train.num_steps=5`.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash tools/install.sh
exec .venv/bin/megarl train configs/cpu_gsm8k.yaml "$@"
