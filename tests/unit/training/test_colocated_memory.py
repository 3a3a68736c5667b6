"""Colocated memory is enforced, not declared (issue 35 item 1).

- ``megarl validate`` refuses a colocated layout whose planned resident trainer memory (weights,
  gradients, main weights, Adam states, reserve: `megarl.plan`) exceeds
  ``cluster.colocated_trainer_memory_fraction`` of the GPU, naming both numbers (the issue's case:
  Qwen3-30B on H100, ``mem_fraction_static=0.7``, fraction 0.2).
- The device part (`megarl.training.memory_limit`), with spies in place of ``torch.cuda``: the
  cached blocks are released before the cap is set, both on the rank's own device (``cuda:3`` here,
  not ``LOCAL_RANK``), a rank still over its fraction raises, a CPU device touches nothing.
- `megarl.cluster.colocated`: the trainer is capped before the engines resume, uncapped after they
  release. The same on a real GPU: ``tests/gpu/test_colocated_memory_gpu.py``.
"""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megarl.config import load_config
from megarl.config.validate import fit_issues
from megarl.training import memory_limit

REPO = Path(__file__).resolve().parents[3]
RECIPE_30B = str(REPO / "configs" / "qwen3_30b_a3b_gpu.yaml")
COLOCATED = ["cluster.placement=colocated", "rollout.engine.mem_fraction_static=0.7"]


@pytest.mark.timeout(120)
def test_validate_refuses_a_trainer_over_its_colocated_fraction_naming_both_numbers():
    from transformers import AutoConfig

    from megarl.config.device import resolved_precision
    from megarl.plan.gpus import GPUS
    from megarl.plan.memory import TrainerSetup, trainer_memory
    from megarl.plan.shape import ModelShape

    cfg = load_config(RECIPE_30B, [*COLOCATED, "cluster.colocated_trainer_memory_fraction=0.2"])
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(REPO / "configs" / "models" / "qwen3-30b-a3b"))
    mem = trainer_memory(shape, TrainerSetup.from_config(cfg, precision=resolved_precision(cfg)))
    kept = sum(mem.consumers[k] for k in ("weights", "gradients", "main_weights", "adam_states"))
    resident = kept + mem.consumers["reserved"]
    limit = 0.2 * GPUS["h100"].memory_bytes
    assert resident > limit
    (issue,) = [i for i in fit_issues(cfg) if i.key == "cluster.colocated_trainer_memory_fraction"]
    assert f"{kept / 1e9:.1f} GB" in issue.message and f"{resident / 1e9:.1f} GB" in issue.message
    assert f"{limit / 1e9:.1f} GB" in issue.message and "fraction=0.2" in issue.message
    roomy = load_config(RECIPE_30B, ["cluster.placement=colocated", "rollout.engine.mem_fraction_static=0.5",
                                     "cluster.colocated_trainer_memory_fraction=0.4"])
    assert 0.4 * GPUS["h100"].memory_bytes > resident
    assert not [i for i in fit_issues(roomy) if i.key == "cluster.colocated_trainer_memory_fraction"]
    from megarl.plan.fit import plan_fit  # megarl plan's verdict (its exit status) agrees

    hf = AutoConfig.from_pretrained(REPO / "configs" / "models" / "qwen3-30b-a3b")
    assert not plan_fit(cfg, hf, GPUS["h100"], precision="bf16").colocated_fits
    assert plan_fit(roomy, hf, GPUS["h100"], precision="bf16").colocated_fits
    disaggregated = load_config(RECIPE_30B, ["cluster.colocated_trainer_memory_fraction=0.2"])
    assert not [i for i in fit_issues(disaggregated) if i.key == "cluster.colocated_trainer_memory_fraction"]


class CudaSpy:
    """Records the ``torch.cuda`` calls `memory_limit` makes, in order, with their devices."""

    def __init__(self, monkeypatch, *, reserved: int, total: int = 80 << 30):
        self.calls: list[tuple] = []
        self.reserved, self.total = reserved, total
        for name in ("synchronize", "empty_cache", "get_device_properties", "memory_reserved",
                     "set_per_process_memory_fraction"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def synchronize(self, device=None):
        self.calls.append(("synchronize", device))

    def empty_cache(self):
        self.calls.append(("empty_cache",))
        self.reserved //= 2  # what the step cached goes back to the driver

    def get_device_properties(self, device):
        self.calls.append(("get_device_properties", device))
        return SimpleNamespace(total_memory=self.total)

    def memory_reserved(self, device=None):
        self.calls.append(("memory_reserved", device))
        return self.reserved

    def set_per_process_memory_fraction(self, fraction, device=None):
        self.calls.append(("set_per_process_memory_fraction", fraction, device))


def test_shrink_releases_the_cache_then_caps_the_ranks_own_device(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    spy = CudaSpy(monkeypatch, reserved=20 << 30)
    out = memory_limit.shrink(torch.device("cuda:3"), 0.2)
    names = [c[0] for c in spy.calls]
    assert names.index("empty_cache") < names.index("memory_reserved") < names.index("set_per_process_memory_fraction")
    assert ("set_per_process_memory_fraction", 0.2, torch.device("cuda:3")) in spy.calls
    assert all(c[1] == torch.device("cuda:3") for c in spy.calls if len(c) == 2)
    assert out == {"colocated/trainer_reserved_gb": (10 << 30) / 1e9, "colocated/trainer_limit_gb": 0.2 * (80 << 30) / 1e9}
    memory_limit.lift("cuda:3")
    assert spy.calls[-1] == ("set_per_process_memory_fraction", 1.0, torch.device("cuda:3"))


def test_a_rank_still_over_its_fraction_raises_naming_both_numbers(monkeypatch):
    spy = CudaSpy(monkeypatch, reserved=40 << 30)  # 20 GiB after the release: over 0.2 x 80 GiB
    held, total = (20 << 30) / 1e9, (80 << 30) / 1e9
    with pytest.raises(RuntimeError, match=re.escape(f"{held:.2f} GB") + ".*" + re.escape(
            f"fraction=0.2 x {total:.1f} GB = {0.2 * total:.2f} GB")):
        memory_limit.shrink("cuda:0", 0.2)
    assert "set_per_process_memory_fraction" not in [c[0] for c in spy.calls]
    with pytest.raises(ValueError, match="colocated_trainer_memory_fraction"):
        memory_limit.shrink("cuda:0", 1.5)


def test_cpu_ranks_touch_no_cuda_function(monkeypatch):
    spy = CudaSpy(monkeypatch, reserved=0)
    assert memory_limit.shrink(torch.device("cpu"), 0.2) == {}
    memory_limit.lift("cpu")
    assert spy.calls == []


def test_the_trainer_is_capped_before_engines_resume_and_uncapped_after_they_release(monkeypatch):
    from megarl.cluster import colocated

    events = []
    monkeypatch.setattr(colocated, "_call", lambda urls, method, tags: events.append((method, tuple(tags))))
    trainer = SimpleNamespace(colocated_memory=lambda cap: events.append(("trainer_cap", cap)))
    tags = colocated.release(["http://e0"], weights=True, trainer=trainer)
    colocated.resume(["http://e0"], tags, trainer=trainer)
    assert events == [("release_memory_occupation", ("weights", "kv_cache", "cuda_graph")), ("trainer_cap", False),
                      ("trainer_cap", True), ("resume_memory_occupation", ("weights",)),
                      ("resume_memory_occupation", ("kv_cache", "cuda_graph"))]
