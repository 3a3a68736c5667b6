"""megarl validate: GPU-run settings and cross-feature conflicts, each error naming its key (issue 18)."""
from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config, validate

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture()
def base(tiny_moe_dir):
    """A valid 2-rank CPU config on the tiny MoE (same as test_config_validate's)."""
    data = REPO / "data" / "gsm8k"
    return [f"model.hf_path={tiny_moe_dir}", f"data.train_path={data / 'train.jsonl'}",
            f"data.eval_path={data / 'test.jsonl'}", "cluster.device=cpu", "train.precision=fp32",
            "cluster.trainer_devices_per_node=2", "parallel.expert_model_parallel_size=2",
            "train.global_batch_size=16", "rollout.num_prompts_per_step=4", "rollout.group_size=4"]


def _issues(overrides) -> dict[str, str]:
    try:
        validate(load_config(REPO / "configs" / "base.yaml", overrides))
    except ConfigError as err:
        return {issue.key: str(issue) for issue in err.issues}
    return {}


def test_fp8_delayed_recipe_rejected_with_gspo(base):
    issues = _issues(base + ["train.fp8=e4m3", "train.fp8_recipe=delayed"])
    assert "train.fp8_recipe" in issues and "GSPO" in issues["train.fp8_recipe"]
    assert "train.fp8_recipe" not in _issues(base + ["train.fp8=e4m3", "train.fp8_recipe=tensorwise"])
    assert "train.fp8_recipe" not in _issues(base + ["train.fp8=e4m3", "train.fp8_recipe=delayed",
                                                     "algorithm.policy_loss=ppo_clip", "algorithm.clip_low=0.2",
                                                     "algorithm.clip_high=0.28"])


def test_fp8_recipe_checked_against_the_visible_gpu(base, monkeypatch):
    """Where a GPU is visible validate asks fp8_support_error about it (here: an emulated A100)."""
    import torch

    from megarl.training import fp8

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(fp8, "installed_te_version", lambda: "2.9.0")
    issues = _issues(base + ["cluster.device=cuda", "train.precision=bf16", "train.fp8=e4m3"])
    assert "train.fp8_recipe" in issues and "8.9 or higher" in issues["train.fp8_recipe"]
