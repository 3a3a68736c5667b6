"""Token log-probabilities and entropy from vocabulary-sharded logits, never gathering the vocabulary.

With tensor parallelism Megatron's output layer leaves each TP rank the logits of its slice of the
(padded) vocabulary, ``[T, V/tp]``, rank ``r`` holding ids ``[r V/tp, (r + 1) V/tp)``. The
log-softmax needs only three numbers per token from the other ranks:

    m = max_v z_v                     (all-reduce MAX over the TP group)
    Z = sum_v exp(z_v - m)            (all-reduce SUM)
    z_y - m                           (all-reduce SUM; only the rank owning the target id adds it)
    log p(y) = (z_y - m) - log Z
    H = log Z - sum_v p_v (z_v - m)   (one more all-reduce SUM of sum_v exp(z_v - m) (z_v - m))

so the communication is ``O(T)`` and never ``O(T V)``. The entropy metric (``entropy="metric"``) is
this exact formula, from the log-sum-exp of the logprob pass and a dot product taken while its exp
pass runs (no log over the vocabulary, no second ``[T, V/tp]`` buffer); it is computed only when
asked for (the trainer asks when it logs ``loss/entropy`` or trains on the entropy).

Both are `torch.autograd.Function` s with hand-written backward passes
(``d log p(y) / d z_v = 1[v = y] - p_v``; ``d H / d z_v = -p_v (z_v - E_p[z])``) that need no communication: every TP
rank holds the same
(replicated) loss, so each rank's gradient for its own vocabulary slice is already complete.

Memory: the pass works in one fp32 ``[T, V/tp]`` buffer (the softmax, then the gradient, in place);
logits marked by `hand_over_logits` (the output layer's, by `megarl.training.forward.run_model`)
are that buffer, and with ``seq_first`` Megatron's ``[S, B, V/tp]`` layout is used as it is.

Vocabulary padding: Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by x
tp``; logits of the padding ids (``>= vocab_size``) are excluded from the softmax, so the result
equals a softmax over the real vocabulary (the rollout engine's).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.training.collectives import all_reduce


def _group_size(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _all_reduce(tensor: Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None) -> Tensor:
    if _group_size(group) > 1:
        all_reduce(tensor, op=op, group=group)
    return tensor


_CHUNK_ELEMENTS = {"cpu": 1 << 16}
"""Elements of a chunk of the entropy pass by device type: on CPU a chunk stays in the L2 cache
(256 KiB in fp32); elsewhere `_CHUNK_ELEMENTS_DEFAULT` (few kernel launches)."""
_CHUNK_ELEMENTS_DEFAULT = 1 << 26

_OWNED = "_megarl_logprobs_may_overwrite"


def hand_over_logits(logits: Tensor) -> Tensor:
    """Mark ``logits`` as a temporary the logprob pass may overwrite (and keep as its softmax).

    `megarl.training.forward.run_model` marks the output layer's logits, which nothing else reads
    (the output layer saves its input, not its output, for backward), so the pass needs no second
    ``[tokens, V/tp]`` buffer. Megatron's own ``vocab_parallel_cross_entropy`` overwrites its input
    the same way. The mark is dropped when the pass consumes the tensor.

    Returns:
        ``logits`` itself.
    """
    setattr(logits, _OWNED, True)
    return logits


def _take_ownership(logits: Tensor) -> bool:
    owned = getattr(logits, _OWNED, False) and logits.dtype == torch.float32 and logits.is_contiguous()
    if getattr(logits, _OWNED, False):
        delattr(logits, _OWNED)
    return owned


def _shifted_local_logits(logits: Tensor, vocab_size: int | None, group: dist.ProcessGroup | None, *,
                          temperature: float = 1.0, overwrite: bool = False) -> tuple[Tensor, int, int]:
    """``z / temperature - max`` in fp32 with padding ids at -inf, the first global vocabulary id
    held here, and the number of real (non-padding) ids held here.

    ``overwrite``: compute in ``logits``' own memory (fp32, contiguous); else in a new buffer.
    """
    local_vocab = logits.shape[-1]
    rank = dist.get_rank(group) if _group_size(group) > 1 else 0
    vocab_start = rank * local_vocab
    z = logits if overwrite else logits.float()
    if z.data_ptr() == logits.data_ptr() and not overwrite:
        z = z.clone()  # modified in place below; never alias the caller's logits
    if temperature != 1.0:
        z.div_(temperature)
    num_real = local_vocab
    if vocab_size is not None and vocab_start + local_vocab > vocab_size:
        num_real = max(vocab_size - vocab_start, 0)
        z[:, num_real:] = float("-inf")
    max_z = z.max(dim=-1).values
    _all_reduce(max_z, dist.ReduceOp.MAX, group)
    z -= max_z.unsqueeze(-1)
    return z, vocab_start, num_real


def _exp_(shifted: Tensor, num_real: int, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """``shifted <- exp(shifted)`` in place, chunk by chunk (on CPU a chunk stays in the cache while
    it is summed); returns ``sum_v exp(s_v)`` per row and, with ``with_entropy``,
    ``sum_v exp(s_v) s_v`` (over the real ids), both ``[T]``, without a second ``[T, V/tp]`` buffer."""
    sum_exp = shifted.new_empty(shifted.shape[0])
    weighted = shifted.new_empty(shifted.shape[0]) if with_entropy else None
    budget = _CHUNK_ELEMENTS.get(shifted.device.type, _CHUNK_ELEMENTS_DEFAULT)
    # at least 8 rows (few Python steps for a large V/tp), at most 1/8 of the buffer (the entropy's scratch)
    rows = max(min(max(budget // max(shifted.shape[1], 1), 8), -(-shifted.shape[0] // 8)), 1)
    scratch = shifted.new_empty(rows, num_real) if with_entropy else None
    shifted[:, num_real:] = 0.0  # the padding ids' exp(-inf)
    for start in range(0, shifted.shape[0], rows):
        chunk = shifted[start:start + rows, :num_real]
        if scratch is not None and weighted is not None:  # with_entropy
            exp_chunk = torch.exp(chunk, out=scratch[:chunk.shape[0]])
            weighted[start:start + rows] = torch.linalg.vecdot(exp_chunk, chunk)
            chunk.copy_(exp_chunk)
        else:
            chunk.exp_()
        torch.sum(chunk, dim=-1, out=sum_exp[start:start + rows])
    return sum_exp, weighted


class _VocabParallelLogprobs(torch.autograd.Function):
    """``log p(targets)`` (and, detached, the entropy) from ``[T, V/tp]`` logits; module docstring."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, vocab_size: int | None, group: dist.ProcessGroup | None,
                with_entropy: bool, temperature: float, overwrite: bool) -> tuple[Tensor, Tensor]:
        z, vocab_start, num_real = _shifted_local_logits(logits, vocab_size, group, temperature=temperature,
                                                         overwrite=overwrite)
        local_vocab = z.shape[-1]
        local_target = targets - vocab_start
        owned = (local_target >= 0) & (local_target < local_vocab)
        local_target = torch.where(owned, local_target, torch.zeros_like(local_target))
        target_z = torch.where(owned, z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), torch.zeros_like(z[..., 0]))
        sum_exp, weighted = _exp_(z, num_real, with_entropy)  # z now holds exp(z - max): the softmax, for backward
        sums = torch.stack([sum_exp, target_z] + ([weighted] if weighted is not None else []))  # one all-reduce
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        sum_exp, target_z = sums[0], sums[1]
        log_sum_exp = sum_exp.log()
        z.div_(sum_exp.unsqueeze(-1))
        # H = log Z - E_p[z - max], from the log-sum-exp and the exp pass (no log over [T, V/tp])
        entropy = log_sum_exp - sums[2] / sum_exp if with_entropy else z.new_zeros(0)
        ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(z, local_target, owned)
        ctx.input_dtype, ctx.temperature = logits.dtype, temperature
        return target_z - log_sum_exp, entropy

    @staticmethod
    def backward(ctx, grad_output: Tensor, _grad_entropy: Tensor):
        softmax, local_target, owned = ctx.saved_tensors
        grad = softmax.mul_(-grad_output.unsqueeze(-1))  # -p_v * g; softmax is not needed afterwards
        rows = owned.nonzero().squeeze(-1)  # only the rank owning the target id adds the one-hot term
        grad[rows, local_target[rows]] += grad_output[rows]
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.to(ctx.input_dtype), None, None, None, None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    """Entropy of the softmax of ``[T, V/tp]`` logits; see the module docstring."""

    @staticmethod
    def forward(ctx, logits: Tensor, vocab_size: int | None, group: dist.ProcessGroup | None) -> Tensor:
        z, _, _ = _shifted_local_logits(logits, vocab_size, group)
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
                                        tp_group: dist.ProcessGroup | None = None, with_entropy: bool = True,
                                        temperature: float = 1.0, overwrite: bool = False) -> tuple[Tensor, Tensor]:
    """`vocab_parallel_logprobs` plus the entropy (nats) of each row's softmax, detached.

    The entropy comes from the logprob pass itself: ``H = log Z - sum_v exp(s_v) s_v / Z`` with
    ``s = z / temperature - max`` and ``Z = sum_v exp(s_v)`` (the log-sum-exp of the pass), the sum
    taken while the exp pass runs (one more all-reduce SUM of ``[T]``, no log over the vocabulary);
    use `vocab_parallel_entropy` when the entropy itself needs a gradient.

    Args:
        logits, targets, vocab_size, tp_group: as in `vocab_parallel_logprobs`.
        with_entropy: compute the entropy.
        temperature: logits are divided by it first (> 0); the gradient includes the ``1 / temperature``.
        overwrite: compute in ``logits``' memory (fp32, contiguous: else a copy is made) and keep it as
            the softmax for backward; the caller must not read ``logits`` afterwards.

    Returns:
        ``(logprobs [T], entropy [T])`` float32; ``entropy`` is empty (``[0]``) when not ``with_entropy``.

    Raises:
        ValueError: ``logits`` not ``[T, V/tp]`` or ``targets`` not ``[T]``.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [T, V/tp] and targets [T], got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    overwrite = overwrite and logits.dtype == torch.float32 and logits.is_contiguous()
    return _VocabParallelLogprobs.apply(logits, targets, vocab_size, tp_group, with_entropy, temperature, overwrite)


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


def _next_token_pairs(logits: Tensor, input_ids: Tensor, *,
                      seq_first: bool) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor]]:
    """The (position, next token) pairs of `next_token_logprobs`, flattened for one pass.

    Returns:
        ``(flat_logits [N, V/tp], targets [N] int64, shifted)``: ``shifted`` maps per-pair values
        ``[N]`` back to ``[..., S]`` (``[R, S]`` with ``seq_first``), 0 in column 0. With
        ``seq_first`` ``N = S R`` (a view of the logits; the last position's dummy target is
        dropped by ``shifted``), else ``N = (S - 1) x rows``.

    Raises:
        ValueError: ``seq_first`` logits not ``[S, R, V/tp]`` for ``input_ids`` ``[R, S]``.
    """
    local_vocab = logits.shape[-1]
    if seq_first:
        rows, length = input_ids.shape
        if tuple(logits.shape[:2]) != (length, rows) and not (rows == 1 and logits.shape[:2] == (1, length)):
            raise ValueError(f"seq_first logits must be [S, R, V/tp] = [{length}, {rows}, V/tp], "
                             f"got {tuple(logits.shape)}")
        flat_logits = logits.reshape(length * rows, local_vocab)  # a view of contiguous logits
        # position s predicts s + 1; the last position gets a dummy target and its result is dropped
        targets = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1).t().reshape(-1)

        def shifted(values: Tensor) -> Tensor:  # [S R] in (s, r) order -> [R, S], 0 in column 0
            return torch.cat([values.new_zeros(1, rows), values.view(length, rows)[:-1]]).t()
        return flat_logits, targets, shifted
    lead, length = input_ids.shape[:-1], input_ids.shape[-1]
    flat_logits = logits[..., :-1, :].reshape(-1, local_vocab)
    targets = input_ids[..., 1:].reshape(-1)

    def shifted(values: Tensor) -> Tensor:  # type: ignore[no-redef]  # one per branch
        values = values.view(*lead, length - 1)
        return torch.cat([values.new_zeros(*lead, 1), values], dim=-1)
    return flat_logits, targets, shifted


def next_token_logprobs(logits: Tensor, input_ids: Tensor, *, vocab_size: int | None = None,
                        tp_group: dist.ProcessGroup | None = None, temperature: float = 1.0,
                        entropy: str = "none", seq_first: bool = False) -> tuple[Tensor, Tensor | None]:
    """Logprob of every token given the ones before it in its row.

    Args:
        logits: ``[..., S, V/tp]`` logits of rows of ``S`` tokens; ``logits[..., s, :]`` predicts
            token ``s + 1`` of the same row. With ``seq_first``: ``[S, R, V/tp]``, the layout of
            Megatron's output layer (``input_ids`` then ``[R, S]``), used as it is: no copy of the
            logits, all ``S R`` positions go through one pass (the last one's result is dropped)
            so that the gradient is one ``[S R, V/tp]`` buffer. Logits marked by
            `hand_over_logits` (fp32) are overwritten by the pass instead of copied.
        input_ids: ``[..., S]`` int64 token ids of the same rows.
        vocab_size, tp_group: as in `vocab_parallel_logprobs`.
        temperature: logits are divided by it first (the rollout's sampling temperature, so the
            trainer scores tokens under the distribution the engine sampled from).
        entropy: ``"none"``; ``"metric"`` (detached, from the same pass's log-sum-exp: see
            `vocab_parallel_logprobs_and_entropy`); ``"grad"`` (differentiable, a second pass: for
            an entropy bonus).
        seq_first: ``logits`` are ``[S, R, V/tp]`` (see above).

    Returns:
        ``(logprobs, entropy)``: ``[..., S]`` float32 with ``logprobs[..., s] = log p(input_ids[..., s] | ...)``
        and 0 in column 0 (no context); ``entropy[..., s]`` is that of the distribution token
        ``s`` was drawn from (0 in column 0), or None. Positions at the start of a packed
        sequence hold values conditioned on the previous sequence: mask them (``loss_mask`` is 0 there).

    Raises:
        ValueError: on an unknown ``entropy`` mode, or logits not matching ``input_ids``.
    """
    if entropy not in ("none", "metric", "grad"):
        raise ValueError(f"entropy must be 'none', 'metric' or 'grad', got {entropy!r}")
    overwrite = _take_ownership(logits) and entropy != "grad"  # the entropy's own pass reads the logits
    flat_logits, targets, shifted = _next_token_pairs(logits, input_ids, seq_first=seq_first)
    if entropy == "grad":
        flat_logits = flat_logits / temperature if temperature != 1.0 else flat_logits
        scores = vocab_parallel_logprobs(flat_logits, targets, vocab_size=vocab_size, tp_group=tp_group)
        ent = vocab_parallel_entropy(flat_logits, vocab_size=vocab_size, tp_group=tp_group)
        return shifted(scores), shifted(ent)
    scores, ent = vocab_parallel_logprobs_and_entropy(flat_logits, targets, vocab_size=vocab_size, tp_group=tp_group,
                                                      with_entropy=entropy == "metric", temperature=temperature,
                                                      overwrite=overwrite)
    return shifted(scores), shifted(ent) if entropy == "metric" else None
