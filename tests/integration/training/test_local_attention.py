"""The local spec's fused attention (`LocalSDPAttention`) == Megatron-Core's own ``DotProductAttention``.

One gloo rank, the tiny Qwen3-MoE (grouped-query attention), fp32. Packed micro batches of several
sequences per row (block-diagonal causal mask) go through ``run_model`` and ``micro_batch_logprobs``;
the logprobs and every parameter gradient are compared with the same model run through
``DotProductAttention.forward`` (the reference: Megatron's code), to 1e-6. Also: the logits
``run_model`` returns are the output layer's own ``[S, R, V/tp]`` tensor (no copy), equal to
``GPTModel``'s ``[R, S, V/tp]`` output, and the logprobs equal a full-vocabulary ``log_softmax`` of
that output.
"""
from unittest import mock

import pytest
import torch

from megarl.testing.multiproc import run_ranks

LENS = [37, 5, 60, 21, 44, 9, 30]


def _batch():
    from megarl.training.batch import TrainBatch

    gen = torch.Generator().manual_seed(3)
    cu = torch.tensor([0] + LENS).cumsum(0)
    n = int(cu[-1])
    loss_mask = torch.ones(n, dtype=torch.bool)
    loss_mask[cu[:-1]] = False
    return TrainBatch(input_ids=torch.randint(0, 150, (n,), generator=gen), cu_seqlens=cu, loss_mask=loss_mask,
                      advantages=torch.zeros(len(LENS)), rollout_logprobs=torch.zeros(n))


def _run(model, mb, vocab_size, weights, parallel):
    """Logprobs of the micro batch's real tokens, their weighted sum's gradients, and the logits."""
    from megarl.training import forward as fwd
    model.zero_grad()
    seen = []
    hook = model.output_layer.register_forward_hook(lambda m, a, out: seen.append(out[0].data_ptr()))
    logits = fwd.run_model(model, mb, parallel=parallel)
    hook.remove()
    no_copy = seen == [logits.data_ptr()]
    plain = logits.detach().clone()
    lp, _ = fwd.micro_batch_logprobs(logits, mb, vocab_size=vocab_size, tp_group=None, temperature=0.7,
                                     entropy="none")
    (lp * weights[:lp.numel()]).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), grads, plain, no_copy


def _module_paths(model, packed_mask):
    """Max |LocalSDPAttention - DotProductAttention| of one layer's core attention for each kind of
    mask: the packed mask, the same mask without its remembered segments (found from the mask),
    a mask that is not block-diagonal (SDPA with the bool mask), and no mask (causal)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    module = model.decoder.layers[0].self_attention.core_attention
    heads, groups = module.num_attention_heads_per_partition, module.num_query_groups_per_partition
    length, rows = packed_mask.shape[-1], packed_mask.shape[0]
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(length, rows, heads, module.hidden_size_per_attention_head, generator=gen)
    k, v = (torch.randn(length, rows, groups, module.hidden_size_per_attention_head, generator=gen) for _ in range(2))
    other = torch.rand(rows, 1, length, length, generator=gen) < 0.5
    other &= ~torch.eye(length, dtype=torch.bool)  # every query sees itself: no fully masked row
    diffs = {}
    for name, mask in {"packed": packed_mask, "found": packed_mask.clone(), "general": other, "none": None}.items():
        out = module(q, k, v, mask)
        ref = DotProductAttention.forward(module, q, k, v, mask)
        diffs[name] = float((out - ref).abs().max())
    return diffs


def _worker(rank, world_size, hf_dir):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.training.batching import MicroBatchSpec
    from megarl.training.local_attention import LocalSDPAttention
    from megarl.training.micro_batch import pack_micro_batch
    from megarl.training.model import build_model, load_hf_config
    from megarl.training.parallel_state import destroy_parallel, initialize_parallel

    parallel = initialize_parallel(ParallelConfig(), backend="gloo", seed=5)
    try:
        (model,) = build_model(hf_dir, ParallelConfig(), ModelConfig(), precision="fp32", device="cpu")
        kinds = {type(m).__name__ for m in model.modules() if isinstance(m, DotProductAttention)}
        vocab_size = load_hf_config(hf_dir).vocab_size
        batch = _batch()
        spec = MicroBatchSpec(rows=((0, 1, 2, 3), (4, 5, 6)), row_length=128, num_tokens=sum(LENS))
        mb = pack_micro_batch(batch, spec)
        weights = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(4))
        fused = _run(model, mb, vocab_size, weights, parallel)
        with mock.patch.object(LocalSDPAttention, "forward", DotProductAttention.forward):
            reference = _run(model, mb, vocab_size, weights, parallel)
            model_output = model(mb.input_ids, mb.position_ids, mb.attention_mask).detach()  # GPTModel's [R, S, V]
        paths = _module_paths(model, mb.attention_mask)
        return kinds, fused, reference, model_output[..., :vocab_size], mb.input_ids, mb.flat_index, mb.cu_seqlens, paths
    finally:
        destroy_parallel()


@pytest.mark.timeout(300)
def test_sdpa_attention_matches_megatron_dot_product_attention(tiny_moe_dir):
    kinds, fused, reference, model_output, input_ids, flat_index, cu, paths = run_ranks(
        _worker, 1, args=(str(tiny_moe_dir),), timeout_s=280)[0]
    assert kinds == {"LocalSDPAttention"}
    assert max(paths.values()) <= 1e-6, paths
    (lp, grads, logits, no_copy), (ref_lp, ref_grads, ref_logits, _) = fused, reference
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for name in grads:  # 1e-6 of the gradient's scale
        scale = float(ref_grads[name].abs().max())
        diff = float((grads[name] - ref_grads[name]).abs().max())
        assert diff <= 1e-6 * max(scale, 1.0), (name, diff, scale)
    # run_model: the output layer's own [S, R, V] logits, no copy; GPTModel returns them as [R, S, V]
    assert no_copy and logits.shape[:2] == input_ids.shape[::-1]
    vocab_size = model_output.shape[-1]
    torch.testing.assert_close(ref_logits.transpose(0, 1)[..., :vocab_size], model_output, rtol=0, atol=0)
    # logprobs == log_softmax of GPTModel's output at temperature 0.7 (padding ids excluded)
    logp = torch.log_softmax(model_output.double() / 0.7, -1)
    expected = torch.zeros_like(logp[..., 0])
    expected[:, 1:] = logp[:, :-1].gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    expected = expected.reshape(-1)[flat_index].index_fill(0, cu[:-1], 0.0)
    torch.testing.assert_close(ref_lp.double(), expected, rtol=0, atol=1e-5)
