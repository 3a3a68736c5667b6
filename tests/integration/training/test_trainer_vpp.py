"""Interleaved pipeline (PP2 x VPP2) gives the TP1 (DP2) loss and grad norm on a 4-layer MoE, with
R2 routing replay recording every layer's routes across the virtual stages."""
import pytest
import torch
from megarl_trainer_cases import build, make_batch, make_cfg, teardown

from megarl.testing.multiproc import run_ranks

LAYOUTS = {"tp1": {}, "pp2_vpp2": {"parallel.pipeline_model_parallel_size": 2,
                                   "parallel.virtual_pipeline_model_parallel_size": 2}}


@pytest.fixture(scope="module")
def four_layer_moe_dir(tmp_path_factory):
    from megarl.models.tiny import TinyModelSpec, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "moe4", TinyModelSpec(family="qwen3_moe", num_hidden_layers=4))


def _worker(rank, world_size, hf_dir, batch):
    out = {}
    for name, layout in LAYOUTS.items():
        trainer = build(make_cfg(hf_dir, {**layout, "algorithm.clip_low": 0.9, "algorithm.clip_high": 10.0,
                                          "train.routing_replay": "r2"}))
        prepared = trainer.prepare_batch(batch)
        metrics = trainer.train_step(prepared)
        out[name] = (metrics["loss/policy"], metrics["optim/grad_norm"], metrics["batch/num_microbatches"],
                     prepared.routed_experts)
        teardown(trainer)
    return out


@pytest.mark.timeout(400)
def test_interleaved_pipeline_matches_tp1(four_layer_moe_dir):
    from transformers import AutoConfig

    batch = make_batch(AutoConfig.from_pretrained(four_layer_moe_dir).vocab_size, seed=3)
    gen = torch.Generator().manual_seed(4)
    batch = batch.replace(old_logprobs=-7.0 + 0.5 * torch.randn(batch.num_tokens, generator=gen))
    out = run_ranks(_worker, 2, args=(str(four_layer_moe_dir), batch), timeout_s=360)[0]
    (loss, grad_norm, _, routes), (vpp_loss, vpp_norm, vpp_mbs, vpp_routes) = out["tp1"], out["pp2_vpp2"]
    assert bool((vpp_routes >= 0).all()) and torch.equal(vpp_routes, routes), "R2 recorded the same routes"
    assert vpp_mbs % 2 == 0, "the interleaved schedule needs a multiple of PP micro batches"
    assert vpp_loss == pytest.approx(loss, rel=1e-5)
    assert vpp_norm == pytest.approx(grad_norm, rel=1e-4)
