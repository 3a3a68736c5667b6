"""A policy loss from a plugin outside the package, named by import path, trains a real Megatron step.

A module written into ``tmp_path`` (put on ``sys.path``, as ``PYTHONPATH`` puts it in a user's
processes) defines a vanilla policy-gradient loss with its own hyperparameter ``scale``; the config
names it ``algorithm.policy_loss: my_rl_plugin:reinforce_loss`` with
``algorithm.policy_loss_kwargs: {scale: 0.5}``. One rank builds the tiny MoE trainer and takes one
optimizer step: the reported ``loss/policy`` and ``loss/total`` equal the formula computed here from
the logprobs at the same weights (``-scale * sum_t m_t A_i(t) logp_t / sum_t m_t``), and the weights
move. A path to a missing attribute fails the step with an error naming ``algorithm.policy_loss``.
"""
import sys

import pytest
import torch
from megarl_trainer_cases import build, make_batch, make_cfg, teardown

from megarl.testing.multiproc import run_ranks

PLUGIN = '''
"""A user's policy loss, outside megarl: REINFORCE with a per-sequence advantage (Williams 1992)."""
import torch

from megarl.algorithms.metrics import sum_metric


def reinforce_loss(logprobs, old_logprobs, advantages, loss_mask, *, loss_agg_mode, normalizer, is_weights,
                   entropy, scale):
    keep = loss_mask != 0
    token_terms = torch.where(keep, advantages[:, None] * logprobs, torch.zeros_like(logprobs))
    loss = -scale * token_terms.sum() / normalizer.num_tokens.to(logprobs.dtype)
    return loss, {"loss/policy": sum_metric(loss)}
'''
SCALE = 0.5


def _worker(rank, world_size, hf_dir, batch, plugin_dir):
    from megarl.plugins import PluginError

    sys.path.insert(0, plugin_dir)  # what PYTHONPATH does in the user's trainer processes
    trainer = build(make_cfg(hf_dir, {"algorithm.policy_loss": "my_rl_plugin:reinforce_loss",
                                      "algorithm.policy_loss_kwargs": {"scale": SCALE}}))
    prepared = trainer.prepare_batch(batch)
    logprobs = trainer.compute_logprobs(prepared)  # the weights the step's forward runs at
    before = {name: p.detach().clone() for name, p in trainer.named_parameters_for_sync()}
    metrics = trainer.train_step(prepared)
    moved = sum(not torch.equal(before[name], p) for name, p in trainer.named_parameters_for_sync())
    trainer.cfg.algorithm.policy_loss = "my_rl_plugin:missing_loss"
    try:
        trainer.train_step(prepared)
        error = None
    except PluginError as e:
        error = str(e)
    teardown(trainer)
    return {"metrics": metrics, "logprobs": logprobs, "loss_mask": prepared.loss_mask,
            "advantages": prepared.advantages, "cu_seqlens": prepared.cu_seqlens, "moved": moved,
            "num_params": len(before), "error": error}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_plugin_loss_by_import_path_trains_a_megatron_step(tiny_moe_dir, tmp_path):
    from transformers import AutoConfig

    (tmp_path / "my_rl_plugin.py").write_text(PLUGIN)
    batch = make_batch(AutoConfig.from_pretrained(tiny_moe_dir).vocab_size, seed=3)
    [out] = run_ranks(_worker, 1, args=(str(tiny_moe_dir), batch, str(tmp_path)), timeout_s=360)
    cu, mask = out["cu_seqlens"], out["loss_mask"]
    seq_of_token = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
    token_advantages = out["advantages"][seq_of_token].double()
    expected = -SCALE * float((token_advantages * out["logprobs"].double())[mask].sum() / mask.sum())
    assert abs(expected) > 1e-3  # the formula is not trivially 0 on this batch
    assert out["metrics"]["loss/policy"] == pytest.approx(expected, rel=1e-5)
    assert out["metrics"]["loss/total"] == pytest.approx(expected, rel=1e-5)
    assert "loss/clip_frac_low" not in out["metrics"]  # no built-in loss ran
    assert out["moved"] > out["num_params"] // 2, (out["moved"], out["num_params"])
    assert "algorithm.policy_loss" in out["error"] and "missing_loss" in out["error"], out["error"]
