"""Colocated offload (issue 35 item 1, last part): ``cluster.colocated_offload``.

- ``megarl validate`` / ``megarl plan`` count what is offloaded as not resident: the issue's
  Qwen3-30B layout at a fraction its resident memory only fits without the optimizer is refused with
  a hint naming ``cluster.colocated_offload``, and validates once the key is set (reference: the
  plan's own consumers, summed here).
- `megarl.training.memory_limit.offload` / ``restore`` with spies on Megatron-Core's calls
  (``offload_to_cpu`` / ``restore_from_cpu``, ``offload_grad_buffers`` / ``restore_grad_buffers``),
  and the colocated path's order: offload, then shrink; lift, then restore (``TrainerWorker``).
- A real Megatron-Core trainer (tiny Qwen3-MoE, gloo, one rank, CPU): offload then restore leaves
  the parameters and the optimizer state bit-identical, and the next optimizer step equals a run
  without offload. On CPU Megatron's optimizer offload moves nothing (it moves CUDA tensors only);
  the gradient buffers are really freed and reallocated.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megarl.config import load_config
from megarl.config.validate import fit_issues
from megarl.training import memory_limit

REPO = Path(__file__).resolve().parents[3]
RECIPE_30B = str(REPO / "configs" / "qwen3_30b_a3b_gpu.yaml")
KEY = "cluster.colocated_trainer_memory_fraction"


@pytest.mark.timeout(120)
def test_a_layout_that_fits_only_with_offload_validates_when_the_key_is_set():
    from transformers import AutoConfig

    from megarl.config.device import resolved_precision
    from megarl.plan.fit import plan_fit
    from megarl.plan.gpus import GPUS
    from megarl.plan.memory import TrainerSetup, trainer_memory
    from megarl.plan.shape import ModelShape

    hf = AutoConfig.from_pretrained(REPO / "configs" / "models" / "qwen3-30b-a3b")
    base = load_config(RECIPE_30B, ["cluster.placement=colocated", "rollout.engine.mem_fraction_static=0.6"])
    mem = trainer_memory(ModelShape.from_hf_config(hf), TrainerSetup.from_config(base, precision=resolved_precision(base)))
    c = mem.consumers
    without_optimizer = c["weights"] + c["gradients"] + c["reserved"]
    total = GPUS["h100"].memory_bytes
    fraction = round((without_optimizer / total) + 0.01, 2)  # fits without the optimizer, not with it
    assert without_optimizer + c["main_weights"] + c["adam_states"] > fraction * total
    over = [*base_overrides(), f"{KEY}={fraction}"]
    (issue,) = [i for i in fit_issues(load_config(RECIPE_30B, over)) if i.key == KEY]
    assert "cluster.colocated_offload=optimizer " in issue.message
    offloaded = load_config(RECIPE_30B, [*over, "cluster.colocated_offload=optimizer"])
    assert not [i for i in fit_issues(offloaded) if i.key == KEY]
    assert plan_fit(offloaded, hf, GPUS["h100"], precision="bf16").colocated_fits
    too_small = load_config(RECIPE_30B, [*base_overrides(), f"{KEY}=0.05", "cluster.colocated_offload=optimizer_and_grads"])
    (issue,) = [i for i in fit_issues(too_small) if i.key == KEY]  # weights alone do not fit: no offload hint
    assert "colocated_offload=" not in issue.message and f"{(c['weights'] + c['reserved']) / 1e9:.1f} GB" in issue.message


def base_overrides() -> list[str]:
    return ["cluster.placement=colocated", "rollout.engine.mem_fraction_static=0.6"]


class MegatronSpy:
    """Records the Megatron-Core offload calls and the CUDA device current during each."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple] = []
        self.current = None
        spy = self

        class Device:
            def __init__(self, device):
                self.device = device

            def __enter__(self):
                spy.current = self.device

            def __exit__(self, *exc):
                spy.current = None

        monkeypatch.setattr(torch.cuda, "device", Device)
        self.optimizer = SimpleNamespace(offload_to_cpu=lambda: self._log("offload_to_cpu"),
                                         restore_from_cpu=lambda: self._log("restore_from_cpu"))
        self.chunks = [SimpleNamespace(
            offload_grad_buffers=lambda synchronize, empty_cache, i=i: self._log("offload_grad_buffers", i, synchronize, empty_cache),
            restore_grad_buffers=lambda synchronize, i=i: self._log("restore_grad_buffers", i, synchronize))
            for i in range(2)]

    def _log(self, *call):
        self.calls.append((*call, self.current))


@pytest.mark.parametrize("mode", ["none", "optimizer", "optimizer_and_grads"])
def test_offload_and_restore_call_megatron_on_the_ranks_device(monkeypatch, mode):
    spy = MegatronSpy(monkeypatch)
    cuda3 = torch.device("cuda:3")
    memory_limit.offload(spy.optimizer, spy.chunks, mode, cuda3)
    offloaded, spy.calls = spy.calls, []
    memory_limit.restore(spy.optimizer, spy.chunks, mode, "cuda:3")
    restored = spy.calls
    optimizer = mode != "none"
    grads = mode == "optimizer_and_grads"
    assert offloaded == ([("offload_to_cpu", cuda3)] if optimizer else []) + \
        ([("offload_grad_buffers", i, True, True, None) for i in range(2)] if grads else [])
    assert restored == ([("restore_grad_buffers", i, True, None) for i in range(2)] if grads else []) + \
        ([("restore_from_cpu", cuda3)] if optimizer else [])


def test_cpu_moves_no_optimizer_state_and_frees_grads_without_cuda_calls(monkeypatch):
    spy = MegatronSpy(monkeypatch)
    memory_limit.offload(spy.optimizer, spy.chunks, "optimizer_and_grads", "cpu")
    memory_limit.restore(spy.optimizer, spy.chunks, "optimizer_and_grads", torch.device("cpu"))
    assert spy.calls == [("offload_grad_buffers", 0, False, False, None), ("offload_grad_buffers", 1, False, False, None),
                         ("restore_grad_buffers", 0, False, None), ("restore_grad_buffers", 1, False, None)]
    with pytest.raises(ValueError, match="cluster.colocated_offload"):
        memory_limit.offload(spy.optimizer, spy.chunks, "grads", "cpu")


def test_the_colocated_path_offloads_before_the_cap_and_restores_after_lifting_it(monkeypatch):
    from megarl.launch.trainer_group import TrainerWorker

    events = []
    monkeypatch.setattr(memory_limit, "offload", lambda opt, chunks, mode, device: events.append(("offload", mode, device)))
    monkeypatch.setattr(memory_limit, "restore", lambda opt, chunks, mode, device: events.append(("restore", mode, device)))
    monkeypatch.setattr(memory_limit, "shrink", lambda device, fraction: events.append(("shrink", fraction)) or {})
    monkeypatch.setattr(memory_limit, "lift", lambda device: events.append(("lift",)))
    cfg = SimpleNamespace(cluster=SimpleNamespace(colocated_offload="optimizer"))
    worker = SimpleNamespace(trainer=SimpleNamespace(cfg=cfg, optimizer=None, model_chunks=[], device="cuda:1"))
    method = TrainerWorker.__ray_metadata__.modified_class.colocated_memory
    method(worker, 0.3)
    method(worker, None)
    assert events == [("offload", "optimizer", "cuda:1"), ("shrink", 0.3), ("lift",), ("restore", "optimizer", "cuda:1")]


def test_validate_refuses_offload_where_it_cannot_apply():
    from megarl.config.validate import config_issues

    def keys(overrides):
        return {i.key for i in config_issues(load_config(RECIPE_30B, overrides), check_paths=False)}

    assert "cluster.colocated_offload" in keys(["cluster.colocated_offload=optimizer"])  # disaggregated
    assert "cluster.colocated_offload" in keys([*base_overrides(), "cluster.colocated_offload=optimizer",
                                               "train.precision=fp32"])
    assert "cluster.colocated_offload" not in keys([*base_overrides(), "cluster.colocated_offload=optimizer"])


def _batch(seed: int):
    """A `TrainBatch` of 4 random sequences of 12 tokens, every token after the first trained."""
    from megarl.training.batch import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 200, (4, 12), generator=gen)
    cu = torch.arange(0, 49, 12, dtype=torch.int64)
    mask = torch.ones(48, dtype=torch.bool)
    mask[cu[:-1]] = False
    return TrainBatch(input_ids=ids.flatten(), cu_seqlens=cu, loss_mask=mask,
                      advantages=torch.randn(4, generator=gen), rollout_logprobs=torch.zeros(48))


def _optimizer_state(optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters and every tensor of its state, in a fixed order (copies)."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                out.append(p.detach().clone())
                out.extend(v.clone() for _, v in sorted(opt.optimizer.state[p].items()) if torch.is_tensor(v))
    return out


def _offload_worker(rank, world_size, hf_dir: str, mode: str) -> dict:
    from megarl.config.schema import MegarlConfig
    from megarl.conversion.initial_weights import initial_weights
    from megarl.training.trainer_build import build_trainer

    cfg = MegarlConfig()
    cfg.model.hf_path, cfg.cluster.device, cfg.train.precision = hf_dir, "cpu", "fp32"
    cfg.train.lr, cfg.train.max_tokens_per_microbatch = 1e-2, 64
    trainer = build_trainer(cfg, load_weights=initial_weights(cfg.model))
    trainer.train_step(trainer.prepare_batch(_batch(0)))  # Adam states exist
    params = [p.detach().clone() for p in trainer.model_chunks[0].parameters()]
    state = _optimizer_state(trainer.optimizer)
    memory_limit.offload(trainer.optimizer, trainer.model_chunks, mode, trainer.device)
    buffers = [b for chunk in trainer.model_chunks for b in chunk.buffers + chunk.expert_parallel_buffers]
    freed = [b.grad_data.untyped_storage().size() == 0 for b in buffers]
    memory_limit.restore(trainer.optimizer, trainer.model_chunks, mode, trainer.device)
    same = all(torch.equal(a, p.detach()) for a, p in zip(params, trainer.model_chunks[0].parameters())) and \
        all(torch.equal(a, b) for a, b in zip(state, _optimizer_state(trainer.optimizer)))
    trainer.train_step(trainer.prepare_batch(_batch(1)))
    return {"freed": freed, "same": same, "state_tensors": len(state),
            "after": [p.detach().clone() for p in trainer.model_chunks[0].parameters()]}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_offload_and_restore_on_a_real_megatron_trainer_change_nothing(tiny_moe_dir):
    from megarl.testing.multiproc import run_ranks

    (offloaded,) = run_ranks(_offload_worker, 1, args=(str(tiny_moe_dir), "optimizer_and_grads"), timeout_s=500)
    (plain,) = run_ranks(_offload_worker, 1, args=(str(tiny_moe_dir), "none"), timeout_s=500)
    assert offloaded["freed"] and all(offloaded["freed"]) and not any(plain["freed"])
    assert offloaded["same"] and offloaded["state_tensors"] > len(offloaded["after"])  # params + Adam states
    assert all(torch.equal(a, b) for a, b in zip(offloaded["after"], plain["after"]))
    assert len(offloaded["after"]) == len(plain["after"])
