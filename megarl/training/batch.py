"""`TrainBatch`: what the driver hands the trainer for one RL step (docs/architecture.md).

A `TrainBatch` holds ``B`` sequences (prompt + response, one per trajectory) **packed** end to end:
every per-token field is ``[T_total]`` (``T_total = sum_i L_i``) and ``cu_seqlens`` ``[B + 1]``
marks where each sequence starts. Per-token fields are indexed by the token they describe:

- ``loss_mask[t] = 1`` trains token ``t`` (a policy-generated response token); 0 on the prompt,
  on tool observations and template tokens appended by the agent loop.
- ``*_logprobs[t] = log p(input_ids[t] | input_ids[<t])`` within the same sequence; the first
  token of every sequence has no context, its entry is 0 and its ``loss_mask`` must be 0.
- ``routed_experts[t, l, k]``: the ``k``-th expert (global, HF numbering) layer ``l`` routed
  token ``t`` to; a row of ``-1`` means "not recorded" (the router chooses freely for that token),
  which is what the last token of each R3 trajectory holds (no engine forward read it).

The driver cuts a step's `TrainBatch` into one shard per data-parallel rank
(`megarl.training.shard`), with the partition the trainer's micro-batch planner uses
(`megarl.training.batching`); each rank receives only its shard.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from megarl.rollout.types import Trajectory


@dataclasses.dataclass(kw_only=True)
class TrainBatch:
    """``B`` packed sequences and their RL quantities.

    Attributes:
        input_ids: ``[T_total]`` int64, prompt + response token ids of every sequence, end to end.
        cu_seqlens: ``[B + 1]`` int64, ``cu_seqlens[i]:cu_seqlens[i+1]`` is sequence ``i``
            (``cu_seqlens[0] = 0``, ``cu_seqlens[B] = T_total``).
        loss_mask: ``[T_total]`` bool, True = trained token (see the module docstring).
        advantages: ``[B]`` float32, one advantage per sequence.
        rollout_logprobs: ``[T_total]`` float32, the rollout engine's logprob of each token; 0.0
            where ``loss_mask`` is False.
        old_logprobs: ``[T_total]`` float32 logprobs of the trainer at the sampling-time weights
            (`Trainer.compute_logprobs`), or None until computed.
        ref_logprobs: ``[T_total]`` float32 logprobs of the reference policy, or None.
        routed_experts: ``[T_total, L, K]`` int32 expert ids per token and MoE layer for routing
            replay (-1 rows = not recorded), or None.
        policy_version: ``[B]`` int64, the policy version that generated each sequence.
        rewards: ``[B]`` float32 trajectory rewards (for metrics only).

    Raises:
        ValueError: from ``__post_init__`` when shapes, dtypes or ``cu_seqlens`` are inconsistent,
            or a sequence's first token is in the loss mask.
    """

    input_ids: Tensor
    cu_seqlens: Tensor
    loss_mask: Tensor
    advantages: Tensor
    rollout_logprobs: Tensor
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    routed_experts: Tensor | None = None
    policy_version: Tensor | None = None
    rewards: Tensor | None = None

    def __post_init__(self) -> None:
        total = self.input_ids.shape[0]
        if self.input_ids.dim() != 1 or self.input_ids.dtype != torch.int64:
            raise ValueError(f"TrainBatch.input_ids must be a [T_total] int64 tensor, got "
                             f"{tuple(self.input_ids.shape)} {self.input_ids.dtype}")
        cu = self.cu_seqlens
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total:
            raise ValueError(f"TrainBatch.cu_seqlens must be [B + 1] from 0 to T_total={total}, got {cu.tolist()}")
        if bool((cu[1:] <= cu[:-1]).any()):
            raise ValueError("TrainBatch.cu_seqlens must be strictly increasing (no empty sequence)")
        self.loss_mask = self.loss_mask.to(torch.bool)
        for name in ("loss_mask", "rollout_logprobs", "old_logprobs", "ref_logprobs", "routed_experts"):
            value = getattr(self, name)
            if value is not None and value.shape[0] != total:
                raise ValueError(f"TrainBatch.{name} has {value.shape[0]} rows, input_ids has {total}")
        num_seqs = self.num_sequences
        if self.policy_version is None:
            self.policy_version = torch.zeros(num_seqs, dtype=torch.int64)
        for name in ("advantages", "policy_version", "rewards"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (num_seqs,):
                raise ValueError(f"TrainBatch.{name} must be [B]=[{num_seqs}], got {tuple(value.shape)}")
        if self.routed_experts is not None and self.routed_experts.dim() != 3:
            raise ValueError(f"TrainBatch.routed_experts must be [T_total, L, K], got "
                             f"{tuple(self.routed_experts.shape)}")
        first_trained = self.loss_mask[cu[:-1]].nonzero()
        if first_trained.numel():
            raise ValueError(f"TrainBatch.loss_mask is set on the first token of sequence "
                             f"{int(first_trained[0])}, which has no context to predict it from")

    @property
    def num_sequences(self) -> int:
        """B."""
        return int(self.cu_seqlens.numel() - 1)

    @property
    def seq_lens(self) -> Tensor:
        """``[B]`` int64 sequence lengths (prompt + response tokens)."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def num_tokens(self) -> int:
        """T_total."""
        return int(self.input_ids.shape[0])

    def token_index(self, seq_indices: Sequence[int]) -> Tensor:
        """``[sum L_i]`` int64 positions in the packed fields of the given sequences, in order."""
        starts, ends = self.cu_seqlens[:-1].tolist(), self.cu_seqlens[1:].tolist()
        parts = [torch.arange(starts[i], ends[i]) for i in seq_indices]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def select(self, seq_indices: Sequence[int]) -> TrainBatch:
        """A new `TrainBatch` holding the given sequences, in the given order (fields copied)."""
        seq_indices = list(seq_indices)
        if not seq_indices:
            raise ValueError("TrainBatch.select needs at least one sequence")
        tok = self.token_index(seq_indices)
        seq = torch.tensor(seq_indices, dtype=torch.int64)
        lens = self.seq_lens[seq]
        cu = torch.zeros(len(seq_indices) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lens, 0)

        def take(value: Tensor | None, index: Tensor) -> Tensor | None:
            return None if value is None else value[index]

        return TrainBatch(
            input_ids=self.input_ids[tok], cu_seqlens=cu, loss_mask=self.loss_mask[tok],
            advantages=self.advantages[seq], rollout_logprobs=self.rollout_logprobs[tok],
            old_logprobs=take(self.old_logprobs, tok), ref_logprobs=take(self.ref_logprobs, tok),
            routed_experts=take(self.routed_experts, tok), policy_version=take(self.policy_version, seq),
            rewards=take(self.rewards, seq),
        )

    def replace(self, **changes: Any) -> TrainBatch:
        """A copy with some fields replaced (e.g. ``old_logprobs=...``); the original is unchanged."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_trajectories(cls, trajectories: Sequence[Trajectory], advantages: Tensor | Sequence[float], *,
                          pack_routes: bool = True) -> TrainBatch:
        """Pack trajectories (prompt + response each) into one batch.

        Args:
            trajectories: ``B`` trajectories; each needs a non-empty prompt.
            advantages: ``[B]`` float, one per trajectory (e.g. from `megarl.algorithms.advantages`).
            pack_routes: pack R3 ``routed_experts``; False leaves them to the ranks (the driver
                sends each rank only its sequences' routes: `megarl.training.shard.BatchShard`).

        Returns:
            The packed batch. ``routed_experts`` is set when the trajectories carry R3 routes
            (``[P + R, L, K]`` each: prompt and response positions, as the engine routed them).

        Raises:
            ValueError: on an empty list, a length mismatch, an empty prompt, or when some
                trajectories carry ``routed_experts`` and others do not, or with different ``[L, K]``.
        """
        if not trajectories:
            raise ValueError("TrainBatch.from_trajectories needs at least one trajectory")
        advantages = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1)
        if advantages.shape[0] != len(trajectories):
            raise ValueError(f"advantages has {advantages.shape[0]} entries for {len(trajectories)} trajectories")
        for i, traj in enumerate(trajectories):
            if traj.prompt_ids.numel() == 0:
                raise ValueError(f"trajectory {i} has an empty prompt; the first token cannot be trained")
        lens = [t.prompt_ids.numel() + t.response_ids.numel() for t in trajectories]
        cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(torch.tensor(lens), 0)
        input_ids = torch.cat([torch.cat([t.prompt_ids.long(), t.response_ids.long()]) for t in trajectories])
        loss_mask = torch.cat([torch.cat([torch.zeros(t.prompt_ids.numel(), dtype=torch.bool), t.loss_mask.bool()])
                               for t in trajectories])
        rollout_logprobs = torch.cat([
            torch.cat([torch.zeros(t.prompt_ids.numel()), t.rollout_logprobs.float()]) for t in trajectories])
        rollout_logprobs = torch.where(loss_mask, rollout_logprobs, torch.zeros_like(rollout_logprobs))
        return cls(
            input_ids=input_ids, cu_seqlens=cu, loss_mask=loss_mask, advantages=advantages,
            rollout_logprobs=rollout_logprobs,
            routed_experts=_pack_routed_experts(trajectories) if pack_routes else None,
            policy_version=torch.tensor([t.policy_version for t in trajectories], dtype=torch.int64),
            rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        )


def _pack_routed_experts(trajectories: Sequence[Trajectory]) -> Tensor | None:
    """``[T_total, L, K]`` int32 (each trajectory's ``[P + R, L, K]`` in order), or None when no
    trajectory has routes."""
    have = [t.routed_experts is not None for t in trajectories]
    if not any(have):
        return None
    # A trajectory that never reached the engine (truncated before its first turn) has no routes
    # and nothing to train: its rows route freely. Any other trajectory without routes is an error.
    missing = [i for i, t in enumerate(trajectories) if not have[i] and t.num_model_tokens > 0]
    if missing:
        raise ValueError(f"trajectory {missing[0]} has no routed_experts while trajectory "
                         f"{have.index(True)} has them; routing replay needs them for every trajectory")
    shape = tuple(trajectories[have.index(True)].routed_experts.shape[1:])  # type: ignore[union-attr]  # have
    parts = []
    for i, traj in enumerate(trajectories):
        rows = traj.prompt_ids.numel() + traj.response_ids.numel()
        routes = traj.routed_experts
        if routes is None:
            routes = torch.full((rows, *shape), -1, dtype=torch.int32)
        if routes.dim() != 3 or tuple(routes.shape) != (rows, *shape):
            raise ValueError(f"trajectory {i} routed_experts has shape {tuple(routes.shape)}, "
                             f"expected [P + R = {rows}, {shape[0]}, {shape[1]}]")
        parts.append(routes.to(torch.int32))
    return torch.cat(parts)


def packed_to_padded(values: Tensor, cu_seqlens: Tensor, pad_value: float = 0.0) -> Tensor:
    """Unpack ``[T_total, ...]`` per-token values into a right-padded ``[B, L_max, ...]`` tensor.

    Args:
        values: ``[T_total, ...]`` packed per-token values (any dtype; autograd flows through).
        cu_seqlens: ``[B + 1]`` int64 sequence boundaries.
        pad_value: fill value of the padding positions.

    Returns:
        ``[B, L_max, ...]`` with sequence ``i`` in row ``i``, positions ``>= L_i`` set to ``pad_value``.
    """
    cu_seqlens = cu_seqlens.to(values.device)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    num_seqs, max_len = lens.numel(), int(lens.max()) if lens.numel() else 0
    pos = torch.arange(max_len, device=values.device)
    valid = pos[None, :] < lens[:, None]
    index = (cu_seqlens[:-1, None] + pos[None, :]).clamp(max=max(values.shape[0] - 1, 0))
    gathered = values[index.reshape(-1)].reshape(num_seqs, max_len, *values.shape[1:])
    mask = valid.reshape(num_seqs, max_len, *([1] * (values.dim() - 1)))
    return torch.where(mask, gathered, torch.full_like(gathered, pad_value))
