"""``parallel.context_parallel_size > 1`` is refused on CPU at validate time (before Ray starts),
naming the field, and accepted on CUDA (Transformer Engine attention runs CP there)."""
from pathlib import Path

import pytest

from megarl.cli import main as cli_main
from megarl.config import ConfigError, load_config, validate

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture()
def cp2_overrides(tiny_moe_dir):
    data = REPO / "data" / "gsm8k"
    return [f"model.hf_path={tiny_moe_dir}", f"data.train_path={data / 'train.jsonl'}",
            f"data.eval_path={data / 'test.jsonl'}", "cluster.trainer_devices_per_node=2",
            "parallel.context_parallel_size=2", "parallel.expert_model_parallel_size=2",
            "train.global_batch_size=16", "rollout.num_prompts_per_step=4", "rollout.group_size=4"]


def test_cp_on_cpu_is_refused_naming_the_field(cp2_overrides):
    with pytest.raises(ConfigError) as err:
        validate(load_config(REPO / "configs" / "base.yaml", cp2_overrides + ["cluster.device=cpu",
                                                                              "train.precision=fp32"]))
    assert [issue.key for issue in err.value.issues] == ["parallel.context_parallel_size"]
    assert "Transformer Engine" in str(err.value)


def test_cp_on_cuda_is_accepted(cp2_overrides):
    cfg = validate(load_config(REPO / "configs" / "base.yaml", cp2_overrides + ["cluster.device=cuda"]))
    assert cfg.parallel.context_parallel_size == 2


def test_train_command_stops_before_ray(cp2_overrides, capsys):
    code = cli_main(["train", str(REPO / "configs" / "base.yaml"), *cp2_overrides, "cluster.device=cpu",
                     "train.precision=fp32"])
    assert code == 2
    assert "parallel.context_parallel_size" in capsys.readouterr().err
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
