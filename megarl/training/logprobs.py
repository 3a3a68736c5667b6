"""Token log-probabilities and entropy from vocabulary-sharded logits, never gathering the vocabulary.

With tensor parallelism Megatron's output layer leaves each TP rank the logits of its slice of the
(padded) vocabulary, ``[T, V/tp]``, rank ``r`` holding ids ``[r V/tp, (r + 1) V/tp)``. The
log-softmax needs only three numbers per token from the other ranks:

    m = max_v z_v                     (all-reduce MAX over the TP group)
    Z = sum_v exp(z_v - m)            (all-reduce SUM)
    z_y - m                           (all-reduce SUM; only the rank owning the target id adds it)
    log p(y) = (z_y - m) - log Z
    H = log Z - sum_v p_v (z_v - m)   (one more all-reduce SUM of sum_v exp(z_v - m) (z_v - m))

so the communication is ``O(T)`` and never ``O(T V)``. Both are `torch.autograd.Function` s with
hand-written backward passes (``d log p(y) / d z_v = 1[v = y] - p_v``;
``d H / d z_v = -p_v (z_v - E_p[z])``) that need no communication: every TP rank holds the same
(replicated) loss, so each rank's gradient for its own vocabulary slice is already complete.

Vocabulary padding: Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by x
tp``; logits of the padding ids (``>= vocab_size``) are excluded from the softmax, so the result
equals a softmax over the real vocabulary (the rollout engine's).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.training.collectives import all_reduce


def _group_size(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _all_reduce(tensor: Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> Tensor:
    if _group_size(group) > 1:
        all_reduce(tensor, op=op, group=group)
    return tensor


def _shifted_local_logits(logits: Tensor, vocab_size: int | None, group: dist.ProcessGroup | None) -> tuple[Tensor, int]:
    """``z - max`` in fp32 with padding ids at -inf, and the first global vocabulary id held here."""
    local_vocab = logits.shape[-1]
    rank = dist.get_rank(group) if _group_size(group) > 1 else 0
    vocab_start = rank * local_vocab
    z = logits.float()
    if vocab_size is not None and vocab_start + local_vocab > vocab_size:
        padding = torch.arange(vocab_start, vocab_start + local_vocab, device=z.device) >= vocab_size
        z = z.masked_fill(padding, float("-inf"))
    else:
        z = z.clone()  # modified in place below; never alias the caller's logits
    max_z = z.max(dim=-1).values
    _all_reduce(max_z, dist.ReduceOp.MAX, group)
    z -= max_z.unsqueeze(-1)
    return z, vocab_start


class _VocabParallelLogprobs(torch.autograd.Function):
    """``log p(targets)`` (and, detached, the entropy) from ``[T, V/tp]`` logits; module docstring."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, vocab_size: int | None, group: dist.ProcessGroup | None,
                with_entropy: bool) -> tuple[Tensor, Tensor]:
        z, vocab_start = _shifted_local_logits(logits, vocab_size, group)
        local_vocab = z.shape[-1]
        local_target = targets - vocab_start
        owned = (local_target >= 0) & (local_target < local_vocab)
        local_target = torch.where(owned, local_target, torch.zeros_like(local_target))
        target_z = torch.where(owned, z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), torch.zeros_like(z[..., 0]))
        z.exp_()  # z now holds exp(z - max); reuse its memory for the softmax saved for backward
        sums = torch.stack([z.sum(dim=-1), target_z])  # one all-reduce for both
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        sum_exp, target_z = sums[0], sums[1]
        z.div_(sum_exp.unsqueeze(-1))
        entropy = z.new_zeros(0)
        if with_entropy:  # H = -sum_v p log p from the softmax already in hand (no second exp pass)
            entropy = -torch.special.xlogy(z, z).sum(dim=-1)
            _all_reduce(entropy, dist.ReduceOp.SUM, group)
        ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(z, local_target, owned)
        ctx.input_dtype = logits.dtype
        return target_z - sum_exp.log(), entropy

    @staticmethod
    def backward(ctx, grad_output: Tensor, _grad_entropy: Tensor):
        softmax, local_target, owned = ctx.saved_tensors
        grad = softmax.mul_(-grad_output.unsqueeze(-1))  # -p_v * g; softmax is not needed afterwards
        rows = owned.nonzero().squeeze(-1)  # only the rank owning the target id adds the one-hot term
        grad[rows, local_target[rows]] += grad_output[rows]
        return grad.to(ctx.input_dtype), None, None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    """Entropy of the softmax of ``[T, V/tp]`` logits; see the module docstring."""

    @staticmethod
    def forward(ctx, logits: Tensor, vocab_size: int | None, group: dist.ProcessGroup | None) -> Tensor:
        z, _ = _shifted_local_logits(logits, vocab_size, group)
        exp_z = z.exp()
        z = torch.nan_to_num(z, neginf=0.0)  # padding ids: p = 0, so 0 * z must not be 0 * -inf
        sums = torch.stack([exp_z.sum(dim=-1), (exp_z * z).sum(dim=-1)])
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        sum_exp, sum_exp_z = sums[0], sums[1]
        mean_z = sum_exp_z / sum_exp  # E_p[z]
        ctx.save_for_backward(exp_z.div_(sum_exp.unsqueeze(-1)), z, mean_z)
        ctx.input_dtype = logits.dtype
        return sum_exp.log() - mean_z

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        softmax, z, mean_z = ctx.saved_tensors
        grad = -grad_output.unsqueeze(-1) * softmax * (z - mean_z.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None


def vocab_parallel_logprobs(logits: Tensor, targets: Tensor, *, vocab_size: int | None = None,
                            tp_group: dist.ProcessGroup | None = None) -> Tensor:
    """Log-probability of each target id under the softmax of vocabulary-sharded logits.

    Args:
        logits: ``[T, V/tp]`` float (any float dtype; computed in fp32), this TP rank's vocabulary
            slice; rank ``r`` of ``tp_group`` holds ids ``[r V/tp, (r + 1) V/tp)``.
        targets: ``[T]`` int64 global vocabulary ids.
        vocab_size: the real vocabulary size; ids ``>= vocab_size`` (Megatron's padding) are left
            out of the softmax. None = no padding.
        tp_group: the tensor-parallel group the vocabulary is split over (an all-reduce MAX and
            one SUM of ``[2, T]`` run on it); None or size 1 = unsharded logits.

    Returns:
        ``[T]`` float32 ``log p(targets)``, differentiable w.r.t. ``logits``; identical on every TP rank.
    """
    return vocab_parallel_logprobs_and_entropy(logits, targets, vocab_size=vocab_size, tp_group=tp_group,
                                               with_entropy=False)[0]


def vocab_parallel_logprobs_and_entropy(logits: Tensor, targets: Tensor, *, vocab_size: int | None = None,
                                        tp_group: dist.ProcessGroup | None = None,
                                        with_entropy: bool = True) -> tuple[Tensor, Tensor]:
    """`vocab_parallel_logprobs` plus the entropy (nats) of each row's softmax, detached.

    The entropy reuses the softmax of the logprob pass (one more all-reduce SUM of ``[T]``),
    for metrics; use `vocab_parallel_entropy` when the entropy itself needs a gradient.

    Returns:
        ``(logprobs [T], entropy [T])`` float32; ``entropy`` is empty (``[0]``) when not ``with_entropy``.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [T, V/tp] and targets [T], got {tuple(logits.shape)} and {tuple(targets.shape)}")
    return _VocabParallelLogprobs.apply(logits, targets, vocab_size, tp_group, with_entropy)


def vocab_parallel_entropy(logits: Tensor, *, vocab_size: int | None = None,
                           tp_group: dist.ProcessGroup | None = None) -> Tensor:
    """Entropy ``H = -sum_v p_v log p_v`` (nats) of the softmax of vocabulary-sharded logits.

    Args:
        logits: ``[T, V/tp]`` float, as in `vocab_parallel_logprobs`.
        vocab_size: real vocabulary size (padding ids excluded), or None.
        tp_group: tensor-parallel group (one all-reduce MAX and one SUM of ``[2, T]``), or None.

    Returns:
        ``[T]`` float32 entropy per token, differentiable w.r.t. ``logits``.
    """
    if logits.dim() != 2:
        raise ValueError(f"expected logits [T, V/tp], got {tuple(logits.shape)}")
    return _VocabParallelEntropy.apply(logits, vocab_size, tp_group)


def next_token_logprobs(logits: Tensor, input_ids: Tensor, *, vocab_size: int | None = None,
                        tp_group: dist.ProcessGroup | None = None, temperature: float = 1.0,
                        entropy: str = "none") -> tuple[Tensor, Tensor | None]:
    """Logprob of every token given the ones before it in its row.

    Args:
        logits: ``[..., S, V/tp]`` logits of rows of ``S`` tokens; ``logits[..., s, :]`` predicts
            token ``s + 1`` of the same row.
        input_ids: ``[..., S]`` int64 token ids of the same rows.
        vocab_size, tp_group: as in `vocab_parallel_logprobs`.
        temperature: logits are divided by it first (the rollout's sampling temperature, so the
            trainer scores tokens under the distribution the engine sampled from).
        entropy: ``"none"``; ``"metric"`` (detached, from the same softmax); ``"grad"``
            (differentiable, a second pass: for an entropy bonus).

    Returns:
        ``(logprobs, entropy)``: ``[..., S]`` float32 with ``logprobs[..., s] = log p(input_ids[..., s] | ...)``
        and 0 in column 0 (no context); ``entropy[..., s]`` is that of the distribution token
        ``s`` was drawn from (0 in column 0), or None. Positions at the start of a packed
        sequence hold values conditioned on the previous sequence: mask them (``loss_mask`` is 0 there).

    Raises:
        ValueError: on an unknown ``entropy`` mode.
    """
    if entropy not in ("none", "metric", "grad"):
        raise ValueError(f"entropy must be 'none', 'metric' or 'grad', got {entropy!r}")
    if temperature != 1.0:
        logits = logits / temperature
    lead, length, local_vocab = input_ids.shape[:-1], input_ids.shape[-1], logits.shape[-1]
    flat_logits = logits[..., :-1, :].reshape(-1, local_vocab)
    scores, ent = vocab_parallel_logprobs_and_entropy(flat_logits, input_ids[..., 1:].reshape(-1),
                                                      vocab_size=vocab_size, tp_group=tp_group,
                                                      with_entropy=entropy == "metric")

    def shifted(values: Tensor) -> Tensor:
        values = values.view(*lead, length - 1)
        return torch.cat([values.new_zeros(*lead, 1), values], dim=-1)

    if entropy == "grad":
        ent = vocab_parallel_entropy(flat_logits, vocab_size=vocab_size, tp_group=tp_group)
    return shifted(scores), shifted(ent) if entropy != "none" else None
