"""``model.load_dir``: a trainer starts from the Megatron checkpoint ``megarl convert hf-to-megatron``
wrote, at another layout and another vocabulary padding than the trainer's.

Reference: a trainer started from the HF directory the checkpoint was converted from (its
safetensors, read by the HF loader). The converted model is a perturbed copy of the tiny model, while
``model.hf_path`` names the unperturbed one: a trainer that ignored ``load_dir`` would give the
unperturbed model's logprobs. ``megarl validate`` is checked on the same checkpoint: accepted for
its model, rejected (naming ``model.load_dir``) when missing or of another model.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch
from megarl_trainer_cases import LAYOUTS, build, make_batch, make_cfg, teardown

from megarl.conversion.convert import MARKER_FILE, hf_to_megatron
from megarl.testing.multiproc import run_ranks

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def perturbed_dir(tiny_moe_dir, tmp_path_factory):
    """A copy of the tiny MoE with every weight changed by Gaussian noise (std 0.05)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("perturbed") / "tiny_moe_perturbed"
    shutil.copytree(tiny_moe_dir, out)
    gen = torch.Generator().manual_seed(3)
    tensors = load_file(out / "model.safetensors")
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in tensors.items()},
              out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def converted(perturbed_dir, tmp_path_factory):
    """The perturbed model at TP2 (+SP), its vocabulary padded to a multiple of 96 x 2 (2048 -> 2112
    rows; the trainer pads to 2048)."""
    return hf_to_megatron(perturbed_dir, tmp_path_factory.mktemp("ckpt") / "moe_tp2", tensor_model_parallel_size=2,
                          make_vocab_size_divisible_by=96, timeout_s=240)


def _worker(rank, world_size, hf_dir, perturbed_dir, load_dir, batch):
    layout = LAYOUTS["ep2_alltoall"]
    out = {}
    for name, cfg in (("load_dir", make_cfg(hf_dir, {**layout, "model.load_dir": load_dir})),
                      ("reference", make_cfg(perturbed_dir, layout))):
        trainer = build(cfg)
        out[name] = trainer.compute_logprobs(batch)
        teardown(trainer)
    return out


@pytest.mark.timeout(420)
def test_trainer_starts_from_converted_checkpoint(tiny_moe_dir, perturbed_dir, converted):
    from transformers import AutoConfig

    from megarl.conversion.dist_ckpt import tensor_shapes

    assert tensor_shapes(converted)["embedding.word_embeddings.weight"][0] == (2112, 64)
    batch = make_batch(AutoConfig.from_pretrained(tiny_moe_dir).vocab_size, seed=11)
    out = run_ranks(_worker, 2, args=(str(tiny_moe_dir), str(perturbed_dir), str(converted), batch),
                    timeout_s=360)
    for result in out:
        assert torch.equal(result["load_dir"], result["reference"])
    assert out[0]["load_dir"].abs().sum() > 0


def _overrides(tiny_moe_dir, load_dir):
    data = REPO / "data" / "gsm8k"
    return [f"model.hf_path={tiny_moe_dir}", f"model.load_dir={load_dir}", f"data.train_path={data / 'train.jsonl'}",
            "cluster.device=cpu", "train.precision=fp32", "cluster.trainer_devices_per_node=2",
            "train.global_batch_size=16", "rollout.num_prompts_per_step=4", "rollout.group_size=4"]


def _validate(overrides):
    from megarl.config import load_config
    from megarl.launch.preflight import preflight  # what `megarl validate` runs: config's rules and checkpoint's

    return preflight(load_config(REPO / "configs" / "base.yaml", overrides))


def _load_dir_issue(overrides) -> str:
    from megarl.config import ConfigError

    with pytest.raises(ConfigError) as info:
        _validate(overrides)
    issues = [i for i in info.value.issues if i.key == "model.load_dir"]
    assert len(issues) == 1, info.value.issues
    return issues[0].message


def test_validate_load_dir(tiny_moe_dir, tiny_dense_dir, converted, tmp_path):
    assert _validate(_overrides(tiny_moe_dir, converted)).model.load_dir == str(converted)
    assert "not a directory" in _load_dir_issue(_overrides(tiny_moe_dir, tmp_path / "absent"))
    (tmp_path / "empty").mkdir()
    assert "hf-to-megatron" in _load_dir_issue(_overrides(tiny_moe_dir, tmp_path / "empty"))
    # the converter recorded another family
    other = tmp_path / "other_family"
    shutil.copytree(converted, other)
    marker = json.loads((other / MARKER_FILE).read_text())
    (other / MARKER_FILE).write_text(json.dumps({**marker, "family": "qwen3"}))
    assert "'qwen3'" in _load_dir_issue(_overrides(tiny_moe_dir, other))
    # another model's checkpoint (a dense model): its stored config.json disagrees
    dense = hf_to_megatron(tiny_dense_dir, tmp_path / "dense", timeout_s=240)
    assert "model_type" in _load_dir_issue(_overrides(tiny_moe_dir, dense))
    # without the stored metadata, the tensor shapes themselves disagree (no experts)
    shutil.rmtree(dense / "hf_config")
    (dense / MARKER_FILE).unlink()
    assert "num_experts" in _load_dir_issue(_overrides(tiny_moe_dir, dense))
