"""DDP overlap (megarl's GPU default), run on CPU/gloo: overlap_grad_reduce + overlap_param_gather
with the distributed optimizer give the same step and the same weight-sync parameters as no overlap.

The parameters are read right after the optimizer step, as a weight sync does: with
``overlap_param_gather`` the step leaves the all-gather to the next forward, so without
``gather_params`` half of every parameter would still hold the old values on each rank.
"""
import pytest
import torch
from megarl_trainer_cases import build, make_batch, make_cfg, teardown

from megarl.testing.multiproc import run_ranks

OVERLAP = {"overlap_grad_reduce": True, "overlap_param_gather": True}


def _worker(rank, world_size, hf_dir, batch):
    out = {}
    for name, overrides in (("plain", {}), ("overlap", OVERLAP)):
        cfg = make_cfg(hf_dir, {"model.megatron_overrides": overrides, "parallel.expert_model_parallel_size": 1})
        trainer = build(cfg)
        assert bool(trainer.model_chunks[0].ddp_config.overlap_param_gather) == bool(overrides)
        metrics = trainer.train_step(batch)
        params = {n: p.detach().clone() for n, p in trainer.named_parameters_for_sync()}
        metrics2 = trainer.train_step(batch)
        out[name] = (metrics["loss/policy"], metrics["optim/grad_norm"], metrics2["loss/policy"], params)
        teardown(trainer)
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_overlap_matches_no_overlap(tiny_moe_dir):
    from transformers import AutoConfig

    batch = make_batch(AutoConfig.from_pretrained(tiny_moe_dir).vocab_size)
    results = run_ranks(_worker, 2, args=(str(tiny_moe_dir), batch), timeout_s=360)
    for out in results:
        loss, grad_norm, loss2, params = out["plain"]
        o_loss, o_grad_norm, o_loss2, o_params = out["overlap"]
        assert o_loss == pytest.approx(loss, rel=1e-6) and o_grad_norm == pytest.approx(grad_norm, rel=1e-5)
        assert o_loss2 == pytest.approx(loss2, rel=1e-5)
        assert params.keys() == o_params.keys()
        for name in params:
            torch.testing.assert_close(o_params[name], params[name], rtol=1e-5, atol=1e-7, msg=name)
