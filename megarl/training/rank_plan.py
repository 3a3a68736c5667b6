"""A trainer rank's part of each step, decided once from its model chunks and parallel layout.

- the **length policy** of the micro-batch plan (`megarl.training.batching.plan_micro_batches`):
  ``each`` micro batch its own length, one length ``across_dp`` ranks, or one ``uniform`` shape;
- the pipeline's p2p settings that go with it (`configure_pipeline_p2p`);
- this rank's packed micro batches of a step or of its shard (`MicroBatchPlanner`);
- the process groups a step's collectives run on: the ranks that hold the same data-parallel
  shard (`peer_group`), the context-parallel group (`cp_group`), the data-parallel group (`dp_group`).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megarl.config.schema import TrainConfig
from megarl.training import context_parallel as cp
from megarl.training.batch import TrainBatch
from megarl.training.batching import plan_micro_batches
from megarl.training.collectives import all_gather_object
from megarl.training.fp8 import fp8_token_multiple
from megarl.training.micro_batch import PackedMicroBatch, pack_micro_batch
from megarl.training.parallel_state import ParallelState
from megarl.training.shard import StepView

ALONE = object()
"""`peer_group` of a rank that shares its data-parallel rank with no other rank."""


def length_policy(model_chunks: list, parallel: ParallelState) -> str:
    """The micro-batch plan's length policy for these chunks (``GPTModel``, possibly DDP-wrapped).

    ``across_dp`` under the allgather MoE dispatcher with EP > 1 (its ranks exchange tokens of one
    length); ``uniform`` with pipeline parallelism under that dispatcher or with virtual stages;
    ``each`` otherwise.
    """
    config = model_chunks[0].config
    dispatcher = getattr(config, "moe_token_dispatcher_type", "alltoall")
    moe = getattr(config, "num_moe_experts", None)
    policy = "across_dp" if moe and dispatcher == "allgather" and parallel.ep_size > 1 else "each"
    if parallel.pp_size > 1 and ((moe and dispatcher == "allgather") or len(model_chunks) > 1):
        # One shape for every micro batch: Megatron refuses variable_seq_lengths with the
        # allgather dispatcher, and the interleaved schedule fails with it on gloo.
        policy = "uniform"
    return policy


def configure_pipeline_p2p(model_chunks: list, policy: str) -> None:
    """Set the chunks' pipeline p2p fields for the length policy ``policy`` (call at PP > 1)."""
    for chunk in model_chunks:
        # p2p exchanges each micro batch's shape (unless all share one)
        chunk.config.variable_seq_lengths = policy != "uniform"
        if dist.get_backend() == "gloo":
            # Batched isend/irecv on gloo mismatches the two tensors a stage exchanges with
            # one peer (PP=2: previous = next stage) in the interleaved schedule: activations
            # arrive in the wrong buffer. Individual send/recv pairs match in order.
            chunk.config.batch_p2p_comm = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class MicroBatchPlanner:
    """Cuts a step (or this rank's shard of it) into this rank's packed micro batches."""

    parallel: ParallelState
    """This rank's parallel state."""
    train: TrainConfig
    """The ``train`` config section (token and sequence budgets per micro batch, FP8)."""
    length_policy: str
    """From `length_policy`."""
    te_attention: bool
    """Transformer Engine attention: THD packed sequences, one sequence per row (else rows packed
    with several sequences and a mask)."""
    num_model_chunks: int
    """Virtual pipeline stages of this rank (> 1: micro batches come in multiples of PP)."""
    cp_group: object | None
    """The context-parallel group (CP > 1), else None."""
    device: torch.device
    """Where the micro batches' tensors go."""

    def micro_batches(self, batch: TrainBatch,
                      step: StepView | None = None) -> tuple[list[PackedMicroBatch], float]:
        """This rank's packed micro batches of ``batch`` (the same for the trainer's
        ``compute_logprobs`` and ``train_step``) and the padding fraction of the whole plan (all ranks).

        Args:
            batch: the whole optimizer step (``step`` None), or this rank's shard of it.
            step: for a shard: the step's sequence lengths and the shard's positions among them.

        Raises:
            ValueError: the shard is not this rank's part of the plan (`megarl.training.batching.dp_partition`).
        """
        p, train = self.parallel, self.train
        seq_lens = batch.seq_lens.tolist() if step is None else list(step.seq_lens)
        pad_multiple = (p.tp_size if p.sequence_parallel else 1) * fp8_token_multiple(train)
        pack: Callable[..., Any] = functools.partial(pack_micro_batch, batch, use_packed_seq_params=self.te_attention)
        if p.cp_size > 1:  # rows hold sequences padded to 2 * CP (padding_fraction then omits that padding)
            seq_lens = [cp.cp_padded_length(n, p.cp_size) for n in seq_lens]
            pad_multiple = cp.cp_row_multiple(p.cp_size, pad_multiple)
            pack = functools.partial(cp.pack_cp_micro_batch, batch, cp_rank=p.cp_rank, cp_size=p.cp_size,
                                     cp_group=self.cp_group)
        plan = plan_micro_batches(seq_lens, dp_size=p.dp_size,
                                  max_tokens_per_microbatch=train.max_tokens_per_microbatch,
                                  micro_batch_size=train.micro_batch_size, pad_multiple=pad_multiple,
                                  length_policy=self.length_policy, pack_rows=not self.te_attention,
                                  microbatch_multiple=p.pp_size if self.num_model_chunks > 1 else 1)
        specs = plan.micro_batches[p.dp_rank]
        if step is not None:  # plan indices (the step's) -> the shard's
            local = {j: i for i, j in enumerate(step.seq_indices)}
            if sorted(i for spec in specs for i in spec.seq_indices) != sorted(local):
                raise ValueError(f"data-parallel rank {p.dp_rank} received sequences {sorted(local)} of the step, "
                                 f"the plan gives it {sorted(i for spec in specs for i in spec.seq_indices)}")
            specs = [dataclasses.replace(spec, rows=tuple(tuple(local[i] for i in row) for row in spec.rows))
                     for spec in specs]
        mbs = [pack(spec).to(self.device) for spec in specs]
        return mbs, plan.padding_fraction


def uses_te_attention(model_chunks: list) -> bool:
    """Whether the chunks attend with Transformer Engine's ``TEDotProductAttention``."""
    return any(type(m).__name__ == "TEDotProductAttention" for chunk in model_chunks for m in chunk.modules())


def cp_group(parallel: ParallelState, *, te_attention: bool):
    """Megatron's context-parallel group at CP > 1 (`megarl.training.context_parallel`), else None.

    Raises:
        NotImplementedError: CP > 1 without Transformer Engine attention.
    """
    if parallel.cp_size == 1:
        return None
    if not te_attention:
        raise NotImplementedError(
            "parallel.context_parallel_size > 1 needs Transformer Engine attention (TEDotProductAttention, "
            "CUDA): Megatron-Core's local DotProductAttention supports context_parallel_size=1 only")
    from megatron.core import parallel_state as mps

    return mps.get_context_parallel_group()


def dp_group(parallel: ParallelState):
    """Megatron's data-parallel group (without CP) at DP > 1, else None."""
    if parallel.dp_size == 1:
        return None
    from megatron.core import parallel_state as mps

    return mps.get_data_parallel_group()


def peer_group(parallel: ParallelState):
    """A process group of the ranks sharing this rank's ``dp_rank`` (collective: every rank calls
    ``dist.new_group`` for every group, in ``dp_rank`` order); None (the world) at DP 1, `ALONE`
    when every rank is its own data-parallel rank."""
    if parallel.dp_size == 1:
        return None
    if parallel.dp_size == parallel.world_size:
        return ALONE
    dp_ranks = all_gather_object(parallel.dp_rank)
    mine = None
    for dp_rank in sorted(set(dp_ranks)):
        group = dist.new_group(ranks=[r for r, d in enumerate(dp_ranks) if d == dp_rank])
        mine = group if dp_rank == parallel.dp_rank else mine
    return mine
