"""Same batch and initial (HF) weights -> same GSPO loss and grad norm at every parallel layout.

One spawned 2-rank gloo job runs the layouts one after another (TP1 = DP2, TP2+SP, EP2 with the
allgather and the alltoall dispatcher, PP2, TP2+EP2 with ETP1), rebuilding Megatron's parallel
state in between. The TP1 loss is also checked against GSPO computed in this test from a plain
transformers forward pass of the same HF model.
"""
import pytest
import torch
from megarl_trainer_cases import LAYOUTS, build, make_batch, make_cfg, teardown

from megarl.testing.multiproc import run_ranks

WIDE_CLIP = {"algorithm.clip_low": 0.9, "algorithm.clip_high": 10.0}  # no clipping: every sequence has a gradient


def _worker(rank, world_size, hf_dir, batch):
    results = {}
    for name, layout in LAYOUTS.items():
        trainer = build(make_cfg(hf_dir, {**layout, **WIDE_CLIP}))
        metrics = trainer.train_step(batch)
        results[name] = (metrics["loss/policy"], metrics["optim/grad_norm"], metrics["batch/num_microbatches"])
        teardown(trainer)
    return results


def _hf_reference_loss(hf_dir, batch):
    """GSPO (paper eq. 5-7, seq-mean-token-mean) from transformers logprobs, written out here."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    seq_losses = []
    with torch.no_grad():
        for i in range(batch.num_sequences):
            start, end = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
            ids = batch.input_ids[start:end]
            logits = model(ids[None]).logits[0].double()
            logp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)
            mask = batch.loss_mask[start + 1:end].double()
            old = batch.old_logprobs[start + 1:end].double()
            ratio = torch.exp(((logp - old) * mask).sum() / mask.sum())
            adv = float(batch.advantages[i])
            seq_losses.append(max(-adv * ratio, -adv * ratio.clamp(1 - 0.9, 1 + 10.0)))
    return float(sum(seq_losses) / len(seq_losses))


@pytest.mark.timeout(600)
def test_loss_and_grad_norm_identical_across_layouts(tiny_moe_dir):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_moe_dir).vocab_size
    batch = make_batch(vocab, seed=3)
    # old logprobs away from the current policy, so the loss and its gradient depend on the weights
    gen = torch.Generator().manual_seed(4)
    batch = batch.replace(old_logprobs=-7.0 + 0.5 * torch.randn(batch.num_tokens, generator=gen))
    results = run_ranks(_worker, 2, args=(str(tiny_moe_dir), batch), timeout_s=540)
    assert results[0] == results[1], "every rank must report the same metrics"
    ref_loss, ref_norm, _ = results[0]["tp1"]
    assert results[0]["tp1"][2] > 1, "the batch should span several micro batches"
    for name, (loss, grad_norm, _) in results[0].items():
        assert loss == pytest.approx(ref_loss, rel=1e-5), name
        assert grad_norm == pytest.approx(ref_norm, rel=1e-4), name
        assert grad_norm > 0
    assert ref_loss == pytest.approx(_hf_reference_loss(tiny_moe_dir, batch), rel=1e-4)
