"""Logprobs in Megatron's ``[S, R, V/tp]`` layout: values, gradients and peak memory.

References: torch's full-vocabulary ``log_softmax`` of the same logits in the ``[R, S, V]`` layout
(values, entropy ``-sum p log p``, gradients by autograd), and the CPU allocator's own record of
allocations and frees (``torch.profiler`` memory events) for the memory of the logprob pass.
"""
import pytest
import torch

from megarl.testing.peak_memory import peak_cpu_bytes
from megarl.training.batch import TrainBatch
from megarl.training.batching import MicroBatchSpec
from megarl.training.forward import micro_batch_logprobs
from megarl.training.logprobs import hand_over_logits
from megarl.training.micro_batch import pack_micro_batch


def _micro_batch(lens, rows, row_length, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + lens).cumsum(0)
    n = int(cu[-1])
    loss_mask = torch.ones(n, dtype=torch.bool)
    loss_mask[cu[:-1]] = False
    batch = TrainBatch(input_ids=torch.randint(0, vocab, (n,), generator=gen), cu_seqlens=cu, loss_mask=loss_mask,
                       advantages=torch.zeros(len(lens)), rollout_logprobs=torch.zeros(n))
    return pack_micro_batch(batch, MicroBatchSpec(rows=rows, row_length=row_length, num_tokens=n))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("entropy", ["none", "metric", "grad"])
def test_seq_first_matches_log_softmax(entropy):
    torch.manual_seed(0)
    vocab, padded = 45, 48
    mb = _micro_batch([7, 9, 4, 12], ((0, 1), (2, 3)), 17, vocab)
    rows, length = mb.shape
    hidden = torch.randn(length, rows, 8, dtype=torch.float64)
    weight = torch.randn(padded, 8, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(int(mb.cu_seqlens[-1]), dtype=torch.float64)

    logits = hidden @ weight.t()  # [S, R, V]: the output layer's layout; overwritten by the pass
    lp, ent = micro_batch_logprobs(hand_over_logits(logits.float()), mb, vocab_size=vocab, tp_group=None,
                                   temperature=0.6, entropy=entropy)
    ((lp.double() * weights).sum() + ((ent.double() * weights).sum() if entropy == "grad" else 0)).backward()
    grad = weight.grad.clone()

    weight.grad = None
    ref = torch.log_softmax((hidden @ weight.t()).transpose(0, 1)[..., :vocab] / 0.6, -1)  # [R, S, V]
    ids = mb.input_ids
    ref_lp = torch.zeros(rows, length, dtype=torch.float64)
    ref_lp[:, 1:] = ref[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    ref_h = torch.zeros(rows, length, dtype=torch.float64)
    ref_h[:, 1:] = -(ref.exp() * ref).sum(-1)[:, :-1]
    real = lambda v: v.reshape(-1)[mb.flat_index].index_fill(0, mb.cu_seqlens[:-1], 0.0)  # noqa: E731
    ((real(ref_lp) * weights).sum() + ((real(ref_h) * weights).sum() if entropy == "grad" else 0)).backward()
    torch.testing.assert_close(lp.double(), real(ref_lp), rtol=0, atol=1e-5)
    if entropy == "none":
        assert ent is None
    else:
        torch.testing.assert_close(ent.double(), real(ref_h), rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, weight.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("entropy", ["none", "metric"])
def test_logprob_pass_needs_no_second_logits_buffer(entropy):
    """The logprob forward and backward of a micro batch add less than half a ``[tokens, V]`` buffer
    to the output layer's logits: one buffer per micro batch."""
    torch.manual_seed(0)
    vocab, hidden_size = 16384, 16
    mb = _micro_batch([300, 212, 500], ((0, 1), (2,)), 512, vocab)
    rows, length = mb.shape
    hidden = torch.randn(length, rows, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    buffer_bytes = length * rows * vocab * 4
    state = {}

    def output_layer():
        state["logits"] = hand_over_logits(hidden @ weight.t())  # [S, R, V] fp32, as run_model returns

    def logprob_pass():
        logits = state.pop("logits")
        lp, ent = micro_batch_logprobs(logits, mb, vocab_size=vocab, tp_group=None, temperature=0.7, entropy=entropy)
        del logits
        (lp.sum() + (0 if ent is None else ent.sum() * 0)).backward()

    output_layer()
    extra = peak_cpu_bytes(logprob_pass)
    assert weight.grad is not None and torch.isfinite(weight.grad).all()
    assert extra < 0.5 * buffer_bytes, f"logprob pass peak {extra / buffer_bytes:.2f} x the logits buffer"
