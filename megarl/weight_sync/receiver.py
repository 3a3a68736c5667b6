"""Engine side of the checked transports (``p2p``, and ``distributed`` where this loader is registered):
a custom SGLang weight loader that receives a bucket, checks it and votes before anything loads.

Registered at engine launch (``--custom-weight-loader megarl.weight_sync.receiver.receive_shards``,
see :data:`megarl.weight_sync.sglang_loader.CUSTOM_WEIGHT_LOADERS`) and named as ``load_format``
of ``/update_weights_from_tensor``. SGLang 0.5.23 hands each TP rank only its own payload and calls
the loader on that rank's scheduler thread; the payload holds one control ticket
(:mod:`megarl.weight_sync.wire`), and the loader does what it says:

- ``connect``: join the stage sender's process group (senders = ranks ``0 .. n - 1``, the stage
  sender first; engine ``i`` rank ``r`` = ``n + i * T + r``, the ticket's ``rank_offset``; NCCL on
  GPU, gloo on CPU: the same code) and keep it for every later sync;
- ``stage``: every bucket of one stage sender's sync, in order (one request per sync and stage:
  no HTTP hop between two buckets). Per bucket: receive this rank's bytes (in the entry's
  ``messages``, byte counts back to back, when they travel in several) from its sender (the
  bucket entry's ``source``: with several senders per stage, the trainer rank that assembled this
  rank's segment; default 0, the stage sender) and then the sender's checksums (one more message,
  :func:`megarl.weight_sync.wire.encode_sums`), check
  every tensor against its checksum and against the served checkpoint (name known, dtype equal,
  shape a shard of its shape), then **vote** (an all-reduce of one status row per group rank):
  only if every rank of every engine (and the sender) is content does any rank load the bucket.
  With owner senders (:mod:`megarl.weight_sync.owners`) the entry lists ``parts`` instead of
  one ``source``: each part comes from its own trainer rank, is received into its place in the
  slice (a strided one through a temporary), and each source's checksums (one per part) follow
  its parts; every part is checked, and the parts must fill every slice, before the vote.
  With owner senders the ticket covers every pipeline stage (one request per engine rank and
  sync, whatever PP) and its ``rounds`` group the entries: each round's buckets (several of each
  stage, :func:`megarl.weight_sync.senders.plan_rounds`) are received at once, from all stages'
  senders, checked each, and voted on together (one vote naming the first failing bucket and tensor).
  A failed vote leaves every engine's weights untouched, tells the sender which tensor failed
  where, and ends the stage (the sender sends no more). After the last bucket: load it, then the
  ``finish`` vote (loading errors, and ``p2p`` buckets not found in the engine's parameters
  after loading: :mod:`megarl.weight_sync.load_proof`, unless the ticket's ``proof`` is false) within the same call. The
  ticket's ``mode`` says
  how the bytes come: ``p2p`` (default): this rank's own slices, point to point, loaded
  pre-sharded (:func:`megarl.weight_sync.sglang_loader.load_presharded`); ``broadcast`` (the
  checked ``distributed`` transport): the whole bucket, one broadcast to every engine rank, each
  shape equal to the checkpoint's, loaded by the model's own ``load_weights`` (which slices it,
  as ``/update_weights_from_distributed`` does). A voted bucket is loaded while the next one's
  bytes arrive (after posting that receive), the stage's last at once;
- ``finish``: load the bucket voted last, then vote once more with any loading error since the
  last ``finish`` (a sender whose stage ticket never went out);
- ``close``: destroy the group.

Nothing here raises into SGLang (an exception in a loader takes the server down): every failure
becomes a status in the vote. The bytes received are counted here, from the message that crossed
the wire, and reported in the vote; with ``MEGARL_WEIGHT_SYNC_STATS_DIR`` set each stage ticket is
recorded in ``receiver_rank{r}.jsonl`` (group, buckets, rounds) and each pre-sharded load in
``rank{r}.jsonl`` like the ``shard`` loader's.
"""
from __future__ import annotations

import logging
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megarl.training.collectives import all_reduce, broadcast, group_device, irecv
from megarl.weight_sync import wire
from megarl.weight_sync.receiver_parts import part_targets, place_parts
from megarl.weight_sync.stacked_experts import manifest_entry, manifest_experts, stack_expert_slices

__all__ = ["RECEIVER", "part_targets", "place_parts", "receive_shards"]

log = logging.getLogger(__name__)

RECEIVER = "megarl.weight_sync.receiver.receive_shards"
"""``--custom-weight-loader`` / ``load_format`` of the ``p2p`` transport."""

_GROUPS: dict[str, dict[str, Any]] = {}
"""group name -> {"group", "rank", "world", "device", "load_errors"} (this scheduler process)."""
_MANIFESTS: dict[str, dict] = {}


def receive_shards(model, named_tensors) -> None:
    """SGLang custom-loader entry point (see module docstring); never raises."""
    from sglang.srt.runtime_context import get_parallel

    tp_rank = get_parallel().tp_rank
    try:
        (name, _), = named_tensors
        ticket = wire.decode_ticket(name)
    except Exception:  # noqa: BLE001 - a loader must not raise (it would kill the server)
        log.error("p2p receiver: payload is not one ticket: %s", traceback.format_exc())
        return
    op = ticket.get("op")
    try:
        if op == "connect":
            _connect(ticket, tp_rank)
        elif op == "stage":
            _stage(model, ticket, tp_rank)
        elif op == "finish":
            state = _GROUPS[ticket["group"]]
            _load_deferred(model, state)
            _finish(state)
        elif op == "close":
            closing = _GROUPS.pop(ticket["group"], None)
            if closing is not None:
                _drop_deferred(closing, "the group closes")
                dist.destroy_process_group(closing["group"])
        else:
            log.error("p2p receiver: unknown op %r", op)
    except Exception:  # noqa: BLE001
        log.error("p2p receiver: %s failed: %s", op, traceback.format_exc())


def _connect(ticket: dict, tp_rank: int) -> None:
    from megarl.weight_sync.sglang_compat import init_custom_process_group

    rank = int(ticket["rank_offset"]) + tp_rank
    backend = ticket["backend"]
    group = init_custom_process_group(
        backend=backend, init_method=f"tcp://{ticket['address']}:{ticket['port']}", world_size=int(ticket["world"]),
        rank=rank, group_name=ticket["group"], timeout=timedelta(seconds=float(ticket["timeout_s"])))
    device = group_device(group)  # nccl: this rank's CUDA device; gloo: the CPU
    _GROUPS[ticket["group"]] = {"group": group, "rank": rank, "world": int(ticket["world"]), "device": device,
                                "load_errors": []}


def _vote(state: dict, row: tuple[int, int, int, int]) -> bool:
    """All-reduce one status row per group rank; True when every rank reported status 0."""
    votes = torch.zeros(state["world"], wire.VOTE_FIELDS, dtype=torch.int64, device=state["device"])
    votes[state["rank"]] = torch.tensor(row, dtype=torch.int64)
    all_reduce(votes, group=state["group"])
    return not bool(votes[:, 0].any())


def _stage(model, ticket: dict, tp_rank: int = 0) -> None:
    """Every round of the ticket in order, then the finish vote; stops at a refused round.

    A round is ``rounds[k]`` consecutive bucket entries received together (owner senders: buckets
    of every pipeline stage, each from its own stage's senders); without
    ``rounds`` every bucket is a round of its own."""
    state = _GROUPS[ticket["group"]]
    _drop_deferred(state, "a new stage ticket came")  # the last sync stopped early
    _record_session(ticket, tp_rank)
    entries = [dict(entry, mode=ticket.get("mode", "p2p"), algo=ticket["algo"], proof=bool(ticket.get("proof", True)))
               for entry in ticket["buckets"]]
    at = 0
    for n in ticket.get("rounds") or [1] * len(entries):
        if not _round(model, state, entries[at:at + int(n)]):
            return  # refused: the senders raise, no finish vote
        at += int(n)
    _load_deferred(model, state)
    _finish(state)


def _record_session(ticket: dict, tp_rank: int) -> None:
    """With ``MEGARL_WEIGHT_SYNC_STATS_DIR`` set: one JSON line per stage ticket (one update request
    of this engine rank) in ``receiver_rank{r}.jsonl``: its group, buckets and rounds."""
    import json
    import os

    from megarl.weight_sync.sglang_loader import STATS_DIR_ENV

    directory = os.environ.get(STATS_DIR_ENV)
    if not directory:
        return
    row = {"tp_rank": tp_rank, "group": ticket["group"], "buckets": [int(e["bucket"]) for e in ticket["buckets"]],
           "rounds": ticket.get("rounds") or [1] * len(ticket["buckets"])}
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"receiver_rank{tp_rank}.jsonl"), "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")


def _round(model, state: dict, entries: list[dict]) -> bool:
    """Receive every bucket of one round (all their receives posted before any wait), check each,
    and vote once: ``(first failing status, its tensor index, bytes received, its bucket)``. True
    when every rank voted for the round (its buckets are then loaded, see :func:`_load_deferred`)."""
    state["slot"] = 1 - state.get("slot", 1)  # the round voted last loads from the other slot's buffers
    posted = []
    for j, entry in enumerate(entries):
        whole = entry.get("mode", "p2p") == "broadcast"
        if entry.get("parts") is not None:  # owner senders: parts from several trainer ranks
            posted.append((entry, whole, *_post_parts(state, entry, j)))
        else:
            posted.append((entry, whole, *_post_segment(state, entry, j, whole=whole)))
    _load_deferred(model, state)  # the previous round loads while this one's bytes arrive
    status, at, index, loads = 0, 0, int(entries[0]["bucket"]), []
    for entry, whole, _, works, _, check in posted:
        for work in works:
            work.wait()
        try:
            got, where, named = check()
        except Exception:  # noqa: BLE001 - still vote, or the senders and the other ranks would wait forever
            log.error("p2p receiver: checking bucket %s failed: %s", entry["bucket"], traceback.format_exc())
            got, where, named = 6, 0, []
        if got and not status:
            status, at, index = got, where, int(entry["bucket"])
        if named:
            loads.append({"bucket": int(entry["bucket"]), "named": named, "whole": whole, "proof": entry["proof"]})
    if not _vote(state, (status, at, sum(p[4] for p in posted), index)):
        log.error("p2p receiver: buckets %s not loaded (status %s at bucket %s tensor %s here, or another rank "
                  "or a sender refused)", [e["bucket"] for e in entries], status, index, at)
        return False
    state["deferred"] = loads
    return True


def _post_segment(state: dict, ticket: dict, j: int = 0, *, whole: bool) -> tuple:
    """Post the receives of a bucket from one sender (its bytes in the entry's ``messages``, then
    its checksums): ``(buffer, works, bytes received, check)``; ``check()`` after the works:
    ``(status, tensor index, [(name, view)])``."""
    # The sender's checksums follow the bytes (an unknown algorithm: none come, decode_sums refuses).
    sums = torch.empty(len(ticket["tensors"]) * wire.DIGEST_CHARS.get(ticket["algo"], 0), dtype=torch.uint8,
                       device=state["device"])
    sizes = [int(n) for n in ticket.get("messages", [int(ticket["nbytes"])])]  # the segment's messages
    # receive what the messages announce (the sender sends those); _check refuses a count that differs (5)
    buffer = _receive_buffer(state, sum(sizes), j)
    messages = list(buffer.split(sizes)) if len(sizes) > 1 else [buffer]
    works = []
    for message in (*messages, sums):  # all posted before loading: the sender never waits on our load
        if message.numel():
            works.append(broadcast(message, 0, group=state["group"], async_op=True) if whole  # one broadcast to all
                         else irecv(message, int(ticket.get("source", 0)), group=state["group"]))

    def check():
        checked = dict(ticket, tensors=[[*entry, s] for entry, s in
                                        zip(ticket["tensors"], wire.decode_sums(sums, ticket["algo"]))])
        return _check(buffer, checked, whole=whole)
    return buffer, works, buffer.numel(), check  # counted from what arrives, not from the ticket


def _post_parts(state: dict, ticket: dict, j: int = 0) -> tuple:
    """Post the receives of a bucket whose parts come from several trainer ranks (owner senders,
    :mod:`megarl.weight_sync.owners`): ``(buffer, works, bytes received, check)`` as
    :func:`_post_segment`. Each part goes straight into its place in the slice where it is
    contiguous there, else into a temporary; each source's checksums (one per part) follow its parts."""
    buffer = _receive_buffer(state, int(ticket["nbytes"]), j)
    slices, placed = part_targets(buffer, ticket)
    works = [irecv(into.reshape(-1).view(torch.uint8), source, group=state["group"])
             for source, _, _, into, _ in placed]
    counts: dict[int, int] = {}
    for source, *_ in placed:
        counts[source] = counts.get(source, 0) + 1
    width = wire.DIGEST_CHARS.get(ticket["algo"], 0)
    sums = {source: torch.empty(n * width, dtype=torch.uint8, device=state["device"]) for source, n in counts.items()}
    works += [irecv(message, source, group=state["group"]) for source, message in sums.items() if message.numel()]
    received = sum(into.numel() * into.element_size() for _, _, _, into, _ in placed)

    def check():
        status, at = place_parts(placed, {s: wire.decode_sums(m, ticket["algo"]) for s, m in sums.items()},
                                  slices, ticket["algo"])
        if status:
            return status, at, []
        checked, tensors = buffer, ticket["tensors"]
        if ticket.get("quantize"):  # sent unquantised (off the FP8 blocks): quantised here, fp8_wire
            from megarl.weight_sync.fp8_wire import quantize_listed

            checked, tensors = quantize_listed(slices, tensors, ticket["quantize"])
        return _check(checked, dict(ticket, tensors=[[*entry[:3], None] for entry in tensors]))
    return buffer, works, received, check


def _load_deferred(model, state: dict) -> None:
    """Load the buckets of the round voted last, if any.

    A voted round is loaded inside the next round's call, after that round's receives were
    posted (so loading overlaps the next transfer), or at once when it is the ticket's last; it is
    only ever one that every rank voted for. Its bytes stay in their receive buffers until then
    (:func:`_receive_buffer` alternates two sets).
    """
    deferred = state.pop("deferred", None)
    for load in [deferred] if isinstance(deferred, dict) else deferred or []:
        _load(model, load["named"], state, load["bucket"], whole=load["whole"], proof=load["proof"])


def _drop_deferred(state: dict, why: str) -> None:
    deferred = state.pop("deferred", None)
    for load in [deferred] if isinstance(deferred, dict) else deferred or []:
        log.error("p2p receiver: bucket %s was voted for but not loaded: %s (its sync did not finish)",
                  load["bucket"], why)


def _load(model, named: list, state: dict, bucket: int, *, whole: bool, proof: bool) -> None:
    """Load one voted bucket (on an engine serving a dequantised view of a block-FP8 checkpoint, CPU:
    :mod:`megarl.rollout.dequantized_view`, its FP8 slices dequantised first; an expert stack's slices
    stacked, :mod:`megarl.weight_sync.stacked_experts`); pre-sharded (``p2p``), then,
    with ``proof`` (the stage ticket's, from
    ``weight_sync.load_proof``), prove every tensor is in the engine's parameters
    (:func:`megarl.weight_sync.load_proof.first_unwritten`). A failure is kept for the
    finish vote: ``(status, tensor index, bucket)``, status 7 (the loader raised) or 9 (not written)."""
    from megarl.weight_sync.load_proof import first_unwritten
    from megarl.weight_sync.sglang_loader import load_presharded, served

    try:
        loaded = served(named)  # FP8 slices dequantised where the engine serves a dequantised view (CPU)
        stacked = _stack_experts(loaded)  # gpt-oss: stacks loaded whole
        if whole:
            model.load_weights(stacked)
            return
        load_presharded(model, stacked)
        missing = first_unwritten(model, loaded) if proof else None
    except Exception:  # noqa: BLE001
        log.error("p2p receiver: loading bucket %s failed: %s", bucket, traceback.format_exc())
        state["load_errors"].append((7, 0, bucket))
        return
    if missing is not None:
        name = loaded[missing][0]
        log.error("p2p receiver: bucket %s: %s was loaded but is in none of the engine's parameters", bucket, name)
        state["load_errors"].append((9, next(i for i, (n, _) in enumerate(named) if n == name), bucket))


def _finish(state: dict) -> None:
    """Vote once more with the first loading error since the last finish (``(status, tensor index,
    0, bucket)``, see :func:`_load`)."""
    errors, state["load_errors"] = state["load_errors"], []
    if errors:
        status, at, bucket = errors[0]
        _vote(state, (status, at, 0, bucket))
    else:
        _vote(state, (0, 0, 0, -1))


def _receive_buffer(state: dict, nbytes: int, j: int = 0) -> torch.Tensor:
    """``[nbytes]`` uint8 on the group's device to receive bucket ``j`` of a round into.

    On CPU two sets of buffers per group are kept and reused, in turn (``state["slot"]``, flipped
    by :func:`_round`): a fresh bucket-sized buffer is fresh memory from the OS, every page of
    which faults while the bytes arrive (the receive then runs at first-touch speed, ~2 GB/s here
    against ~9 for warm memory). Two, because the round voted last is loaded from its buffers
    while the next one arrives in the other set; by the time a set comes round again its round was
    loaded (SGLang's weight loaders copy into the parameters). On CUDA the caching allocator
    reuses blocks by itself (the deferred buckets' views keep their blocks).
    """
    device = state["device"]
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    buffers = state.setdefault("buffers", {})
    key = (state.get("slot", 0), j)
    if buffers.get(key) is None or buffers[key].numel() < nbytes:
        buffers[key] = torch.empty(nbytes, dtype=torch.uint8)
    return buffers[key][:nbytes]


def _check(buffer: torch.Tensor, ticket: dict, *, whole: bool = False) -> tuple[int, int, list]:
    """``(status, tensor index, [(name, view)])`` of one received bucket (status 0 = all good).

    ``whole``: every tensor must have the checkpoint's shape (broadcast mode), not a shard of it.
    """
    from megarl.weight_sync.specs import torch_dtype

    manifest = _manifest()
    views, offset = [], 0
    for index, (name, dtype, shape, expected) in enumerate(ticket["tensors"]):
        known = None if manifest is None else manifest_entry(manifest, name)  # an expert stack's slice too
        if known is None:
            return 2, index, []
        full_shape, full_dtype = known
        if dtype != full_dtype:
            return 4, index, []
        if len(shape) != len(full_shape) or any(s <= 0 or f % s for s, f in zip(shape, full_shape)):
            return 3, index, []
        if whole and tuple(shape) != tuple(full_shape):
            return 3, index, []
        element = torch_dtype(dtype)
        size = torch.Size(shape).numel() * torch.empty(0, dtype=element).element_size()
        if offset + size > buffer.numel():
            return 5, index, []
        raw = buffer[offset:offset + size]
        if expected is not None and wire.checksum(raw, ticket["algo"]) != expected:  # None: checked per part
            return 1, index, []
        views.append((name, raw.view(element).view(shape)))
        offset += size
    if offset != buffer.numel():
        return 5, max(len(views) - 1, 0), []
    return 0, 0, views


def _stack_experts(loaded: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``loaded`` with each complete expert stack stacked (:func:`stack_expert_slices`); the served
    checkpoint's manifest (:func:`_manifest`) is read only where a bucket holds a stack's slices."""
    from megarl.models.mapping import expert_slice

    if all(expert_slice(name)[1] is None for name, _ in loaded):
        return loaded
    return stack_expert_slices(loaded, manifest_experts(_manifest()))


def _manifest() -> dict | None:
    """The served checkpoint's tensors (``read_manifest`` of the engine's model path; of a dequantised
    view, :mod:`megarl.rollout.dequantized_view`, its block-FP8 checkpoint's: what the wire carries), cached."""
    from sglang.srt.runtime_context import get_server_args

    from megarl.rollout.dequantized_view import wire_manifest_dir
    from megarl.weight_sync.manifest_checks import read_manifest

    path = wire_manifest_dir(get_server_args().model_path)  # a dequantised view: its block-FP8 checkpoint's
    if path not in _MANIFESTS:
        try:
            _MANIFESTS[path] = read_manifest(path)
        except Exception:  # noqa: BLE001
            log.error("p2p receiver: cannot read the served checkpoint's tensors at %s: %s", path,
                      traceback.format_exc())
            return None
    return _MANIFESTS[path]
