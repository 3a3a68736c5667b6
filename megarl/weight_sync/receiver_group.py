"""The process group of one stage's senders and every engine rank, on the side of megarl's receiver.

The group (ranks ``0 .. n - 1``: the stage sender, then, with segment senders, the other trainer
ranks of the stage that send segments; then every engine rank) is created inside the first sync by
a ``connect`` ticket to the receiver loader (:func:`megarl.weight_sync.receiver.receive_shards`);
the stage sender hands its name and port to the other senders over the trainer's gloo control
group; it is destroyed on both sides inside a short update session. Base of the checked
transports (:mod:`megarl.weight_sync.checked`).
"""
from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Self

import torch
import torch.distributed as dist

from megarl.weight_sync.engine_clients import wait_all
from megarl.weight_sync.manifest_checks import WeightSyncError
from megarl.weight_sync.plan import Bucket
from megarl.weight_sync.transport import GroupTransport


class ReceiverGroupTransport(GroupTransport):
    """A group transport whose engine side is megarl's receiver loader (see module docstring)."""

    mode = ""
    """The tickets' ``mode`` (set by each checked transport)."""

    def __init__(self, plan, engines, **kwargs) -> None:
        super().__init__(plan, engines, **kwargs)
        self._pp_rank: int | None = None
        self._requests: list = []
        self.senders: list[int] = []
        """The stage's sending trainer ranks (global), stage sender first (:meth:`set_senders`); empty: one sender."""
        self.sender_index = 0
        """This rank's position in ``senders`` = its rank in the group (0: the stage sender)."""
        self._control = None
        self._owners = None
        self._buckets: list[Bucket] = []
        self.load_proof = True
        """``p2p``: the engines prove each loaded bucket is in their parameters (``weight_sync.load_proof``)."""

    @classmethod
    def from_options(cls, plan, engines, options) -> Self:
        """This transport for ``plan`` and ``engines`` with the group options and ``load_proof``."""
        transport = super().from_options(plan, engines, options)
        transport.load_proof = options.load_proof
        return transport

    @property
    def n_senders(self) -> int:
        """Trainer ranks in the group: the stage sender and the helpers (ranks ``0 .. n - 1``)."""
        return max(1, len(self.senders))

    @property
    def world_size(self) -> int:
        """Ranks of the group: the stage senders, then every engine rank of every engine."""
        return self.n_senders + len(self.engines) * self.plan.engine_layout.tp_size

    def set_senders(self, senders: list[int], index: int, control, owners, buckets: list[Bucket]) -> None:
        """Several senders per stage (before the first sync; every sender of the stage calls it).

        Args:
            senders: the stage's sending trainer ranks (global), the stage sender first
                (:meth:`~megarl.weight_sync.segments.SegmentOwners.senders`).
            index: this rank's position in ``senders``; 0 creates the group and announces the stage.
            control: the trainer's gloo control group (the stage sender hands the group's name and
                port to the others over it).
            owners: the :class:`~megarl.weight_sync.segments.SegmentOwners`: who sends each segment.
            buckets: the stage's buckets, in order.
        """
        self.senders, self.sender_index, self._control = list(senders), index, control
        self._owners, self._buckets = owners, list(buckets)

    def _is_mine(self, bucket: Bucket, rank: int) -> bool:
        """This sender sends engine rank ``rank``'s segment of ``bucket``."""
        if self._owners is None:
            return True
        return self._owners.owners(bucket)[rank] == self.senders[self.sender_index]

    def _source(self, bucket: Bucket | None, rank: int) -> int:
        """Group rank of the sender of engine rank ``rank``'s segment of ``bucket`` (None: the finish vote)."""
        if self._owners is None or bucket is None:
            return 0
        return self.senders.index(self._owners.owners(bucket)[rank])

    def _engine_rank(self, engine: int, rank: int) -> int:
        """Group rank of engine ``engine``'s TP rank ``rank``."""
        return self.n_senders + engine * self.plan.engine_layout.tp_size + rank

    def _submit_tickets(self, per_rank: list[dict]) -> list:
        from megarl.weight_sync.receiver import RECEIVER
        from megarl.weight_sync.wire import payload

        payloads = [payload(t) for t in per_rank]
        futures = self.engines.submit_all("update_weights_from_tensor", payloads, load_format=RECEIVER,
                                          flush_cache=False)
        self._requests.extend(futures)
        return futures

    def connect(self, pp_rank: int) -> None:
        """Remember the stage; the group is created inside the first sync's update session
        (SGLang accepts ``/update_weights_from_tensor`` only between ``begin_weight_update`` and
        ``end_weight_update``), after this stage's turn came (stages connect in order)."""
        self._pp_rank = pp_rank

    def _handoff(self, info: dict | None) -> dict | None:
        """The stage sender sends ``info`` (the group's name, address, port; ``{"failed": True}``
        when it failed before creating it) to every other sender over the control group; the
        others return what they received."""
        import json

        from megarl.training.collectives import recv, send

        size = 1024
        if self.sender_index == 0:
            raw = json.dumps(info).encode()
            message = torch.zeros(size, dtype=torch.uint8)
            message[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            for helper in self.senders[1:]:
                send(message, helper, group=self._control, tag=7)
            return None
        message = torch.zeros(size, dtype=torch.uint8)
        recv(message, self.senders[0], group=self._control, tag=7)
        return json.loads(bytes(message.numpy()).rstrip(b"\0").decode())

    def _join_helper(self) -> None:
        """Join the stage sender's group as rank ``sender_index`` (its name and port come over the
        control group)."""
        from megarl.weight_sync.sglang_compat import init_custom_process_group

        info = self._handoff(None)
        if info is None:
            raise WeightSyncError(f"trainer rank {self.senders[self.sender_index]} got no group details from "
                                  f"the stage sender (trainer rank {self.senders[0]})")
        if info.get("failed"):
            raise WeightSyncError(f"the stage sender (trainer rank {self.senders[0]}) failed before creating "
                                  f"the p2p group; see its error")
        self.group_name = info["group"]
        self.group = init_custom_process_group(
            backend=self.backend, init_method=f"tcp://{info['address']}:{info['port']}", world_size=self.world_size,
            rank=self.sender_index, group_name=self.group_name, timeout=timedelta(seconds=self.timeout_s))

    def _join(self) -> None:
        """Create this stage's group: the senders are ranks ``0 .. n - 1`` (the stage sender 0),
        engine ``i`` rank ``r`` is ``n + i*T + r``."""
        import concurrent.futures

        if self.sender_index:
            return self._join_helper()

        from megarl.weight_sync.receiver import RECEIVER
        from megarl.weight_sync.sglang_compat import init_custom_process_group
        from megarl.weight_sync.wire import payload

        tp = self.plan.engine_layout.tp_size
        port = self.group_port()
        self.group_name = f"megarl-{self.mode}-pp{self._pp_rank}-{uuid.uuid4().hex[:8]}"
        ticket = {"op": "connect", "group": self.group_name, "address": self.master_address, "port": port,
                  "world": self.world_size, "backend": self.backend, "timeout_s": self.timeout_s}
        futures = [self.engines.submit(i, "update_weights_from_tensor",
                                       [payload(dict(ticket, rank_offset=self._engine_rank(i, 0)))] * tp,
                                       load_format=RECEIVER, flush_cache=False)
                   for i in range(len(self.engines))]
        if len(self.senders) > 1:
            self._handoff({"group": self.group_name, "address": self.master_address, "port": port})
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # joining blocks: watch the engines meanwhile
            joined = pool.submit(init_custom_process_group, backend=self.backend,
                                 init_method=f"tcp://{self.master_address}:{port}", world_size=self.world_size,
                                 rank=0, group_name=self.group_name, timeout=timedelta(seconds=self.timeout_s))
            deadline = time.monotonic() + self.timeout_s
            while not joined.done():
                failed = [f for f in futures if f.done() and f.exception() is not None]
                if failed or time.monotonic() > deadline:
                    raise WeightSyncError(f"engines did not join the p2p group {self.group_name}: "
                                          f"{failed[0].exception() if failed else 'timeout'}")
                time.sleep(0.01)
            self.group = joined.result()
        wait_all(futures, self.timeout_s)

    def close(self) -> None:
        """Destroy the group on both sides (the engines' side inside a short update session).

        Raises:
            WeightSyncError: an engine kept another update session open for 60 s.
            EngineRequestError: an engine refused a request.
        """
        if self.group is None:
            return
        if self.sender_index:  # the stage sender closes the engines' side
            dist.destroy_process_group(self.group)
            self.group = None
            return
        try:
            self._open_close_session(timeout_s=60)
            try:
                self._submit_tickets([{"op": "close", "group": self.group_name}] * self.plan.engine_layout.tp_size)
                requests, self._requests = self._requests, []
                wait_all(requests, 60)
            finally:
                self.engines.call_all("end_weight_update", timeout_s=60)
        finally:
            dist.destroy_process_group(self.group)
            self.group = None

    def _open_close_session(self, *, timeout_s: float) -> None:
        """``/begin_weight_update`` on every engine, in engine order, waiting while another stage
        sender's close holds the engine's session (with PP > 1 every stage sender closes its own
        group at the same time; SGLang refuses a second open session). The same order for every
        sender: one that holds engine ``i`` already holds ``0 .. i - 1``, so none waits in a cycle."""
        from megarl.rollout.client import EngineRequestError

        deadline = time.monotonic() + timeout_s
        for i in range(len(self.engines)):
            while True:
                try:
                    wait_all([self.engines.submit(i, "begin_weight_update")], timeout_s)
                    break
                except EngineRequestError as err:
                    if "already open" not in str(err):
                        raise
                    if time.monotonic() > deadline:
                        raise WeightSyncError(f"engine {i} ({self.engines.urls[i]}) kept another weight-update "
                                              f"session open for {timeout_s} s; group {self.group_name} not closed "
                                              f"on the engines") from err
                    time.sleep(0.1)
