"""Trajectories on disk: ``run_dir/rollouts/step_N.jsonl`` (``logging.save_rollouts``), and the
``perf/mfu`` metric of a step; both computed by the driver after the step, off the hot path."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

from megarl.launch.mfu import mfu, peak_tflops


def trajectory_record(traj: Any, tokenizer: Any, prompt_key: str = "prompt") -> dict[str, Any]:
    """One trajectory as a JSON-able dict: decoded prompt and response, token counts, tool calls,
    reward and its terms, status, policy version and group id."""
    from megarl.rollout.rewards.composite import TERMS_KEY

    prompt_ids, response_ids = traj.prompt_ids.tolist(), traj.response_ids.tolist()
    meta = traj.metadata or {}
    return {
        "group_id": int(traj.group_id),
        "policy_version": int(traj.policy_version),
        "status": getattr(traj.status, "value", str(traj.status)),
        "reward": float(traj.reward),
        "reward_terms": {k: float(v) for k, v in (meta.get(TERMS_KEY) or {}).items()},
        "num_turns": int(traj.num_turns),
        "tool_calls": meta.get("tool_calls", 0),
        "prompt_tokens": len(prompt_ids),
        "response_tokens": len(response_ids),
        "trained_tokens": int(traj.loss_mask.sum().item()),
        "question": str((traj.sample or {}).get(prompt_key, "")),
        "prompt": tokenizer.decode(prompt_ids, skip_special_tokens=False),
        "response": tokenizer.decode(response_ids, skip_special_tokens=False),
        **({"error": str(meta["error"])} if "error" in meta else {}),
    }


def write_rollouts(run_dir: Path, step: int, groups: Iterable[Any], tokenizer: Any,
                   prompt_key: str = "prompt") -> Path:
    """Write step ``step``'s trajectories (1-based step) to ``run_dir/rollouts/step_{step}.jsonl``."""
    out = Path(run_dir) / "rollouts"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"step_{step}.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for group in groups:
            for traj in group.trajectories:
                f.write(json.dumps(trajectory_record(traj, tokenizer, prompt_key), ensure_ascii=False) + "\n")
    return path


def mean_seq_len(groups: Iterable[Any]) -> float:
    """Mean prompt + response length (tokens) of the trajectories."""
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


def step_mfu(model_config: dict | None, metrics: dict[str, float], seq_len: float, num_devices: int,
             device_name: str, override: float | None) -> float:
    """``perf/mfu`` of a step from ``perf/tokens_per_s``; NaN without a model config, a throughput,
    or a known peak (a CPU or unlisted device with no ``logging.peak_tflops``)."""
    tps = metrics.get("perf/tokens_per_s")
    peak = peak_tflops(device_name, "bf16", override)
    if not model_config or tps is None or math.isnan(peak) or math.isnan(seq_len):
        return math.nan
    return mfu(model_config, tps, seq_len, num_devices, peak)
