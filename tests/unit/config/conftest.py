"""Shared fixtures of the config tests."""
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture()
def good_overrides(tiny_moe_dir):
    """Overrides of ``configs/base.yaml`` that make a valid 2-rank CPU config on the tiny MoE
    (4 heads, 8 experts)."""
    data = REPO / "data" / "gsm8k"
    return [f"model.hf_path={tiny_moe_dir}", f"data.train_path={data / 'train.jsonl'}",
            f"data.eval_path={data / 'test.jsonl'}", "cluster.device=cpu", "train.precision=fp32",
            "cluster.trainer_devices_per_node=2", "parallel.expert_model_parallel_size=2",
            "train.global_batch_size=16", "rollout.num_prompts_per_step=4", "rollout.group_size=4"]
