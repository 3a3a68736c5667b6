"""Trainer side of a weight sync: gather each bucket's Megatron shards on the stage sender and
convert them to checkpoint-style HF tensors.

Every source rank of a bucket (see :class:`megarl.weight_sync.plan.Bucket`) packs its shards of
that bucket into one flat byte buffer and sends it point-to-point to the stage sender over the
trainer's default process group (gloo on CPU, NCCL on GPU). The sender posts the receives of bucket
``b + 1`` before it hands bucket ``b`` to the transport, so gathering the next bucket overlaps
sending the current one. A source rank keeps at most ``max_in_flight`` bucket buffers in flight
and never reuses a buffer before its send completed.

Conversion uses the model family's mapping (``megarl.checkpoint``): shards -> full Megatron tensor
(:func:`~megarl.checkpoint.gather_tp`) -> HF tensors (:func:`~megarl.checkpoint.megatron_to_hf`).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from megarl.weight_sync.plan import Bucket, ParamTransfer, WeightSyncPlan
from megarl.weight_sync.validate import WeightSyncError, check_bucket_tensors

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}


def torch_dtype(name: str) -> torch.dtype:
    """``torch.bfloat16`` for ``"bfloat16"``."""
    return _DTYPES[name]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a tensor's data (copied first if it is not contiguous)."""
    return tensor.contiguous().view(-1).view(torch.uint8)


@dataclass
class GatherTimings:
    """Seconds the sender spent per phase (summed over buckets)."""

    gather_s: float = 0.0
    """Blocked waiting for shards from other ranks (the rest of the gather overlaps sending)."""
    convert_s: float = 0.0
    """Megatron shards -> HF tensors, including validation."""
    bytes_received: int = 0
    """Shard bytes received from other trainer ranks."""
    per_bucket: list = field(default_factory=list)


class HFConverter:
    """Full Megatron tensors -> HF tensors with a ``megarl.checkpoint`` family table.

    Args:
        model_layout: ``Family.layout(hf_config, tp_size=...)`` of the trained model.
    """

    def __init__(self, model_layout) -> None:
        from megarl.checkpoint.mapping import family_table

        self.layout = model_layout
        self.table = family_table(model_layout)

    def __call__(self, transfer: ParamTransfer, shards: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        from megarl.checkpoint.mapping import gather_tp, lookup, megatron_to_hf

        name = transfer.param.name
        entry, _ = lookup(self.table, name)
        full = gather_tp(shards, entry.tp_split)
        return list(megatron_to_hf([(name, full)], self.layout, self.table))


class StageGatherer:
    """Runs the gather half of ``plan`` on trainer rank ``rank`` (every rank of a stage calls it).

    Args:
        plan: the sync plan.
        rank: this rank's global rank (the plan's trainer ranks are global ranks).
        local: global Megatron name -> this rank's shard.
        converter: ``(transfer, shards) -> [(hf_name, tensor), ...]`` (e.g. :class:`HFConverter`).
        max_in_flight: bucket buffers a source rank may have in flight.
        group: process group containing the trainer ranks (default: the default group).
    """

    def __init__(self, plan: WeightSyncPlan, rank: int, local: Mapping[str, torch.Tensor], converter,
                 *, max_in_flight: int = 2, group: Optional[dist.ProcessGroup] = None) -> None:
        self.plan, self.rank, self.local, self.converter = plan, rank, local, converter
        self.max_in_flight, self.group = max_in_flight, group
        self.timings = GatherTimings()

    def my_buckets(self) -> list[Bucket]:
        return [b for b in self.plan.buckets if b.sender_rank == self.rank or b.contributions(self.rank)]

    def is_sender(self) -> bool:
        return any(b.sender_rank == self.rank for b in self.plan.buckets)

    # ------------------------------------------------------------------ source ranks
    def send_contributions(self) -> int:
        """Send this rank's shards of every bucket it does not send itself. Returns bytes sent."""
        in_flight: deque = deque()
        sent = 0
        for bucket in self.plan.buckets:
            if bucket.sender_rank == self.rank:
                continue
            parts = bucket.contributions(self.rank)
            if not parts:
                continue
            while len(in_flight) >= self.max_in_flight:
                work, _buffer = in_flight.popleft()
                work.wait()  # only now may that buffer be freed
            buffer = torch.cat([as_bytes(self.local[t.param.name].detach()) for t, _ in parts])
            work = dist.isend(buffer, bucket.sender_rank, group=self.group, tag=bucket.index)
            in_flight.append((work, buffer))
            sent += buffer.numel()
        for work, _buffer in in_flight:
            work.wait()
        return sent

    # ------------------------------------------------------------------ sender
    def _post_receives(self, bucket: Bucket) -> list[tuple[int, torch.Tensor, object]]:
        posted = []
        device = next(iter(self.local.values())).device if self.local else torch.device("cpu")
        for source_rank, nbytes in sorted(bucket.gather_bytes().items()):
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            posted.append((source_rank, buffer, dist.irecv(buffer, source_rank, group=self.group,
                                                           tag=bucket.index)))
        return posted

    def _shards(self, bucket: Bucket, received: dict[int, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        offsets = {r: 0 for r in received}
        shards: dict[str, list[torch.Tensor]] = {}
        for transfer in bucket.params:
            parts = []
            for source in transfer.sources:
                if source.trainer_rank == self.rank:
                    parts.append(self.local[transfer.param.name].detach())
                    continue
                start = offsets[source.trainer_rank]
                raw = received[source.trainer_rank][start:start + source.nbytes]
                offsets[source.trainer_rank] = start + source.nbytes
                parts.append(raw.view(torch_dtype(transfer.param.dtype)).view(source.shape))
            shards[transfer.param.name] = parts
        return shards

    def iter_hf_buckets(self) -> Iterator[tuple[Bucket, list[tuple[str, torch.Tensor]]]]:
        """Yield ``(bucket, [(hf_name, tensor), ...])`` in wire order for each bucket this rank sends.

        The receives of the next bucket are posted before a bucket is yielded, so the caller's
        send of bucket ``b`` overlaps the gather of ``b + 1``.

        Raises:
            WeightSyncError: converted tensors that do not match the plan.
        """
        mine = [b for b in self.plan.buckets if b.sender_rank == self.rank]
        pending = self._post_receives(mine[0]) if mine else []
        for i, bucket in enumerate(mine):
            start = time.perf_counter()
            for _, _, work in pending:
                work.wait()
            received = {r: buf for r, buf, _ in pending}
            self.timings.bytes_received += sum(buf.numel() for buf in received.values())
            gathered = time.perf_counter()
            pending = self._post_receives(mine[i + 1]) if i + 1 < len(mine) else []
            tensors = self._convert(bucket, self._shards(bucket, received))
            done = time.perf_counter()
            self.timings.gather_s += gathered - start
            self.timings.convert_s += done - gathered
            self.timings.per_bucket.append({"bucket": bucket.index, "gather_s": gathered - start,
                                            "convert_s": done - gathered, "bytes": bucket.nbytes})
            yield bucket, tensors

    def _convert(self, bucket: Bucket, shards: dict[str, list[torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        produced: dict[str, torch.Tensor] = {}
        for transfer in bucket.params:
            for name, tensor in self.converter(transfer, shards[transfer.param.name]):
                if name in produced:
                    raise WeightSyncError(f"{name} produced twice in bucket {bucket.index}")
                produced[name] = tensor
        order = [t.name for t in bucket.hf_tensors]
        planned = set(order)
        tensors = [(n, produced[n]) for n in order if n in produced]
        tensors += [(n, t) for n, t in produced.items() if n not in planned]
        check_bucket_tensors(bucket, tensors)
        return tensors
