"""Model FLOPs utilisation (``perf/mfu``): model FLOPs of the trained tokens over the devices' peak.

FLOPs per trained token (forward + backward, Kaplan et al. 2020 "Scaling Laws", sec. 2.1;
PaLM, Chowdhery et al. 2022, appendix B, for the attention term)::

    flops_per_token = 6 * N_active + 12 * n_layers * hidden * seq_len

``N_active`` = the matmul parameters one token passes through: per layer the attention
projections (q, k, v, o: ``hidden * (n_heads + 2 * n_kv_heads) * head_dim + n_heads * head_dim *
hidden``) and the MLP; for an MoE layer only the ``top_k`` routed experts and the shared experts
count (plus the router ``hidden * n_experts``), never all experts; plus the LM head
``hidden * vocab``. Embedding lookups and norms are not matmuls and are left out (as in PaLM).
``6 = 2`` (multiply-add) ``* 3`` (forward, and backward = 2 x forward). The attention term is the
``Q K^T`` and ``A V`` products (``2 * 2 * seq * hidden`` per layer forward, x3 with backward),
``seq`` = the mean trained sequence length. Activation recomputation is not counted (MFU, not HFU).

``mfu = flops_per_token * tokens_per_s_per_device / peak_flops_per_device``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # dense (no 2:4 sparsity) tensor-core peaks from the vendors' datasheets, TFLOP/s per device
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 67.0},
    "H100 SXM": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 67.0},  # 'NVIDIA H100 80GB HBM3' = SXM
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "fp32": 75.0},
}
"""Known devices by a substring of ``torch.cuda.get_device_name()`` (first match in this order;
'H100 PCIe' before the bare 'H100')."""


def peak_tflops(device_name: str, dtype: str = "bf16", override: float | None = None) -> float:
    """Peak dense TFLOP/s of one device; ``override`` (``logging.peak_tflops``) wins.

    Returns:
        TFLOP/s, or NaN for an unknown device or dtype (a CPU, an unlisted GPU) with no override:
        ``perf/mfu`` is then logged as NaN rather than guessed.
    """
    if override:
        return float(override)
    name = device_name.upper().replace("-", " ")
    for key, peaks in PEAK_TFLOPS.items():
        if key.upper() in name:
            return peaks.get(dtype, math.nan)
    return math.nan


def active_params(cfg: Mapping[str, Any]) -> int:
    """Matmul parameters one token passes through (see the module docstring), from a Hugging Face
    ``config.json`` dict (Llama/Qwen2 dense, Qwen2/3-MoE, Mixtral key names)."""
    hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    attn = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    n_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    mlp_dense = 3 * hidden * int(cfg["intermediate_size"])  # gate, up, down (SwiGLU)
    if n_experts:
        top_k = int(cfg.get("num_experts_per_tok") or 1)
        expert = 3 * hidden * int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        shared_size = int(cfg.get("shared_expert_intermediate_size") or 0)
        shared = 3 * hidden * shared_size + (hidden if shared_size else 0)  # + its sigmoid gate (Qwen2-MoE)
        mlp_moe = top_k * expert + shared + hidden * n_experts
        step = int(cfg.get("decoder_sparse_step") or 1)
        sparse = [i for i in range(layers) if (i + 1) % step == 0 and i not in set(cfg.get("mlp_only_layers") or [])]
        mlp = len(sparse) * mlp_moe + (layers - len(sparse)) * mlp_dense
    else:
        mlp = layers * mlp_dense
    return layers * attn + mlp + hidden * int(cfg["vocab_size"])


def flops_per_token(cfg: Mapping[str, Any], seq_len: float) -> float:
    """Training FLOPs (forward + backward) per token: ``6 * active_params + 12 * L * h * seq``."""
    return 6.0 * active_params(cfg) + 12.0 * int(cfg["num_hidden_layers"]) * int(cfg["hidden_size"]) * seq_len


def mfu(cfg: Mapping[str, Any], tokens_per_s: float, seq_len: float, num_devices: int, peak: float) -> float:
    """Model FLOPs utilisation in [0, 1]: ``flops_per_token * tokens_per_s / (num_devices * peak * 1e12)``.

    Args:
        tokens_per_s: trained tokens per second over all devices.
        seq_len: mean trained sequence length (prompt + response), tokens.
        peak: TFLOP/s of one device (`peak_tflops`); NaN gives NaN.
    """
    return flops_per_token(cfg, seq_len) * tokens_per_s / (num_devices * peak * 1e12)


def mean_seq_len(groups: Iterable[Any]) -> float:
    """Mean prompt + response length (tokens) of the trajectories of ``groups`` (NaN: none)."""
    lens = [t.prompt_ids.numel() + t.response_ids.numel() for g in groups for t in g.trajectories]
    return sum(lens) / len(lens) if lens else math.nan


def gpu_name() -> str:
    """The first GPU's name from ``nvidia-smi`` ("" when it is absent or fails): no CUDA context is
    made in the driver (in a colocated run its GPU memory belongs to the engines and trainer)."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.splitlines()[0].strip() if out.strip() else ""


def step_mfu(model_config: Mapping[str, Any] | None, metrics: Mapping[str, float], seq_len: float, num_devices: int,
             device_name: str, override: float | None) -> float:
    """``perf/mfu`` of a step from ``perf/tokens_per_s``; NaN without a model config, a throughput,
    or a known peak (a CPU or unlisted device with no ``logging.peak_tflops``)."""
    tps = metrics.get("perf/tokens_per_s")
    peak = peak_tflops(device_name, "bf16", override)
    if not model_config or tps is None or math.isnan(peak) or math.isnan(seq_len):
        return math.nan
    return mfu(model_config, tps, seq_len, num_devices, peak)


@dataclasses.dataclass
class MfuMeter:
    """``perf/mfu`` of each RL step (:func:`step_mfu`); the model's ``config.json`` and the GPU's
    name are read once, on first use."""

    model_dir: str | None
    """``model.hf_path`` (None: stand-in runs without a model; MFU is then NaN)."""
    num_devices: int
    """The trainer's devices (``trainer_world_size``)."""
    on_cuda: bool
    """The trainer runs on CUDA (else no GPU name is asked for: NaN without an override)."""
    peak_tflops: float | None
    """``logging.peak_tflops`` (None: the device's table entry)."""

    @functools.cached_property
    def model_config(self) -> dict[str, Any] | None:
        """``config.json`` of :attr:`model_dir`; None where there is none."""
        path = Path(self.model_dir or ".") / "config.json"
        return json.loads(path.read_text(encoding="utf-8")) if self.model_dir and path.is_file() else None

    @functools.cached_property
    def device_name(self) -> str:
        """The trainer's GPU name (:func:`gpu_name`); "" off CUDA."""
        return gpu_name() if self.on_cuda else ""

    def of_step(self, metrics: Mapping[str, float], groups: Iterable[Any]) -> float:
        """The step's MFU in [0, 1] from its ``perf/tokens_per_s`` and trajectories; NaN (not logged)
        on a CPU or an unlisted GPU without ``logging.peak_tflops``."""
        return step_mfu(self.model_config, metrics, mean_seq_len(groups), self.num_devices, self.device_name,
                        self.peak_tflops)
