"""``megarl validate``: colocated on CUDA, the engines' static pool and the trainer's share must fit one GPU.

While colocated engines hold their memory (rollout, weight sync) the trainer keeps its parameters,
gradients and optimizer states on the same GPU. SGLang sizes its pool to ``mem_fraction_static`` of
the GPU's memory; with the default 0.8 and any trainer there is no room. The rule (docs of both keys):
``rollout.engine.mem_fraction_static + cluster.colocated_trainer_memory_fraction <= 0.9``.
"""
from pathlib import Path

import pytest

from megarl.config.loader import ConfigError, load_config
from megarl.config.validate import validate

REPO = Path(__file__).resolve().parents[3]
KEY = "rollout.engine.mem_fraction_static"
LIMIT = 0.9


def _issues(tiny_moe_dir, *overrides) -> dict[str, str]:
    data = REPO / "data" / "gsm8k"
    cfg = load_config(REPO / "configs" / "base.yaml", [
        f"model.hf_path={tiny_moe_dir}", f"data.train_path={data / 'train.jsonl'}", "cluster.device=cuda",
        "train.precision=bf16", "cluster.trainer_devices_per_node=2", "parallel.expert_model_parallel_size=2",
        "train.global_batch_size=16", "rollout.num_prompts_per_step=4", "rollout.group_size=4", *overrides])
    try:
        validate(cfg, check_paths=False)
    except ConfigError as err:  # other checks may object to CUDA on this machine; only KEY matters here
        return {issue.key: issue.message for issue in err.issues}
    return {}


@pytest.mark.parametrize("engine, trainer", [(0.8, 0.4), (0.5, 0.4), (0.6, 0.35), (0.3, 0.7), (0.45, 0.45)])
def test_colocated_memory_shares_must_fit_one_gpu(tiny_moe_dir, engine, trainer):
    issues = _issues(tiny_moe_dir, "cluster.placement=colocated", f"{KEY}={engine}",
                     f"cluster.colocated_trainer_memory_fraction={trainer}")
    fits = engine + trainer <= LIMIT + 1e-9
    assert (KEY not in issues) == fits, issues
    if not fits:
        assert "cluster.colocated_trainer_memory_fraction" in issues[KEY] and KEY in issues[KEY]


def test_separate_gpus_keep_the_engine_default(tiny_moe_dir):
    assert KEY not in _issues(tiny_moe_dir, "cluster.placement=disaggregated", f"{KEY}=0.8")
