"""The SFT cold-start step (megarl.launch.sft.sft_step) on real Megatron ranks, EP2 over gloo.

Reference: transformers' forward of the same HF model on the same sequences, masked NLL computed
in the test (token mean over the whole batch). A second call of the step (same batch) must lower
the NLL, and the RL learning-rate schedule must not advance (SFT steps are not RL steps). A checkpoint
saved before any optimizer step (Megatron-Core's distributed optimizer with torch Adam asserts on an
empty state) loads back to the initial weights.
"""
import pytest
import torch
from megarl_trainer_cases import build, make_batch, make_cfg, teardown

from megarl.testing.multiproc import run_ranks

EP2 = {"parallel.expert_model_parallel_size": 2, "model.moe_token_dispatcher_type": "alltoall",
       "rollout_temperature": 0.5}


def _worker(rank, world_size, hf_dir, batch, ckpt_dir):
    import multiprocessing

    from megarl.launch.sft import sft_step

    multiprocessing.current_process().daemon = False  # dist_checkpointing's writers fork processes

    overrides = {k: v for k, v in EP2.items() if "." in k}
    cfg = make_cfg(hf_dir, overrides)
    cfg.rollout.sampling.temperature = EP2["rollout_temperature"]  # SFT must ignore it (logits at T=1)
    trainer = build(cfg)
    lr_before = trainer.optimizer.param_groups[0]["lr"]
    initial = {name: p.detach().clone() for name, p in trainer.named_parameters_for_sync()}
    trainer.save_checkpoint(ckpt_dir)  # never stepped: Megatron's torch-Adam state_dict needs a primed state
    first = sft_step(trainer, batch, lr=1e-2)
    second = sft_step(trainer, batch, lr=1e-2)
    out = {"first": first, "second": second, "lr_before": lr_before,
           "lr_after": trainer.optimizer.param_groups[0]["lr"], "rl_step": trainer.step}
    trainer.load_checkpoint(ckpt_dir)
    out["restored"] = all(torch.equal(initial[name], p) for name, p in trainer.named_parameters_for_sync())
    out["replayed"] = sft_step(trainer, batch, lr=1e-2)  # Adam from zero moments again: the same first step
    teardown(trainer)
    return out


def _reference_nll(hf_dir, batch) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(batch.cu_seqlens) - 1):
            lo, hi = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
            ids = batch.input_ids[lo:hi]
            logp = torch.log_softmax(model(ids[None]).logits[0].double(), -1)
            token_logp = logp[:-1].gather(-1, ids[1:, None])[:, 0]  # token t predicted from < t
            mask = batch.loss_mask[lo + 1:hi]
            total -= float((token_logp * mask).sum())
            count += int(mask.sum())
    return total / count


@pytest.mark.timeout(300)
def test_sft_step_is_masked_nll_and_learns(tiny_moe_dir, tmp_path):
    from transformers import AutoConfig

    batch = make_batch(AutoConfig.from_pretrained(tiny_moe_dir).vocab_size, seed=3, num_seqs=8)
    batch.loss_mask[batch.cu_seqlens[:-1]] = False  # a sequence's first token has no prediction
    out = run_ranks(_worker, 2, args=(str(tiny_moe_dir), batch, str(tmp_path / "ckpt")), timeout_s=240)
    first, second = out[0]["first"], out[0]["second"]
    assert out[1]["first"] == pytest.approx(first, rel=1e-6), "metrics are identical on every rank"
    assert first["sft/num_tokens"] == int(batch.loss_mask.sum())
    assert first["sft/nll"] == pytest.approx(_reference_nll(tiny_moe_dir, batch), abs=1e-4)
    assert second["sft/nll"] < first["sft/nll"] - 1e-3, (first, second)
    assert first["sft/grad_norm"] > 0
    assert out[0]["lr_after"] == out[0]["lr_before"] and out[0]["rl_step"] == 0
    assert out[0]["restored"], "a checkpoint of a never-stepped optimizer saves and loads"
    assert out[0]["replayed"]["sft/nll"] == pytest.approx(first["sft/nll"], rel=1e-6)
    assert out[0]["replayed"]["sft/grad_norm"] == pytest.approx(first["sft/grad_norm"], rel=1e-5)
