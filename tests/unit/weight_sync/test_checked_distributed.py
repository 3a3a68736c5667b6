"""The ``distributed`` transport checks every bucket where the engines registered megarl's receiver
(issue 19, "a sync that checks itself"): one broadcast of the whole bucket, per-tensor checksums,
a vote before anything loads.

The end-to-end test runs the real sender (:class:`CheckedDistributedTransport`) and the real
receiver (:func:`receiver.receive_shards`) in three processes over gloo (sender + the two ranks of
one TP2 engine); only SGLang's HTTP hop is replaced by files (each request's per-rank payload is
written where that rank's process reads it) and the model by one that records what it loads.
References: the sender's tensors (loaded bytes must equal them), the plan's byte total, and a
flipped byte that must be named and loaded nowhere.
"""
from __future__ import annotations

import base64
import concurrent.futures
import pickle
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megarl.weight_sync import receiver, wire

CONFIG = {"model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 8,
          "num_key_value_heads": 4, "head_dim": 8, "intermediate_size": 64, "moe_intermediate_size": 16,
          "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 1000, "torch_dtype": "float32"}
MANIFEST = {"model.layers.0.self_attn.q_proj.weight": ((8, 4), "float32"), "model.norm.weight": ((4,), "float32")}


def _bucket(tensors):
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in tensors])
    listing = [[n, str(t.dtype).removeprefix("torch."), list(t.shape), wire.checksum(t, "crc32")] for n, t in tensors]
    return flat, {"bucket": 0, "algo": "crc32", "mode": "broadcast", "tensors": listing}


@pytest.mark.parametrize("mutate, status, index", [
    (None, 0, 0),
    (lambda flat, t: flat.__setitem__(130, flat[130] ^ 0x01), 1, 1),                 # a flipped byte in norm
    (lambda flat, t: t["tensors"][0].__setitem__(0, "model.layers.0.q_proj.weight"), 2, 0),  # unknown name
    (lambda flat, t: t["tensors"][1].__setitem__(1, "bfloat16"), 4, 1),              # dtype
])
def test_whole_tensor_check_refuses_and_names_the_tensor(monkeypatch, mutate, status, index):
    monkeypatch.setattr(receiver, "_manifest", lambda: MANIFEST)
    q, norm = torch.randn(8, 4), torch.randn(4)
    flat, ticket = _bucket([("model.layers.0.self_attn.q_proj.weight", q), ("model.norm.weight", norm)])
    if mutate is not None:
        mutate(flat, ticket)
    got, at, views = receiver._check(flat, ticket, whole=True)
    assert (got, at) == (status, index)
    if status == 0:
        assert torch.equal(views[0][1], q) and torch.equal(views[1][1], norm)
    else:
        assert views == []


def test_a_shard_is_refused_where_the_whole_tensor_is_expected(monkeypatch):
    """A TP2 rank's rows of q_proj pass the p2p check but not the broadcast one (wrong shape)."""
    monkeypatch.setattr(receiver, "_manifest", lambda: MANIFEST)
    flat, ticket = _bucket([("model.layers.0.self_attn.q_proj.weight", torch.randn(4, 4))])
    assert receiver._check(flat, ticket, whole=False)[0] == 0
    assert receiver._check(flat, ticket, whole=True)[:2] == (3, 0)


class FileEngines:
    """Stands in for :class:`~megarl.weight_sync.engine_clients.EngineClients` (one engine of ``tp`` ranks):
    request ``k``'s payload for rank ``r`` is written to ``r{r}-{k:05d}``; answers at once."""

    def __init__(self, directory: str, tp: int) -> None:
        self.dir, self.tp, self.seq = Path(directory), tp, 0
        self.urls = ["file://engine0"]

    def __len__(self) -> int:
        return 1

    def submit(self, index, method, *args, **kwargs):
        future = concurrent.futures.Future()
        future.set_result({"success": True})
        if method in ("begin_weight_update", "end_weight_update"):  # close()'s session
            return future
        assert method == "update_weights_from_tensor" and kwargs["load_format"] == receiver.RECEIVER
        payloads, = args
        for rank, text in enumerate(payloads):
            tmp = self.dir / f".r{rank}-{self.seq:05d}"
            tmp.write_text(text)
            tmp.rename(self.dir / f"r{rank}-{self.seq:05d}")
        self.seq += 1
        return future

    def submit_all(self, method, *args, **kwargs):
        return [self.submit(0, method, *args, **kwargs)]

    def call_all(self, *args, **kwargs):
        return []


def _plan():
    from transformers import AutoConfig

    from megarl.weight_sync.layout import EngineLayout, TrainerLayout
    from megarl.weight_sync.model_specs import param_specs_from_hf_config
    from megarl.weight_sync.plan import build_plan

    hf_config = AutoConfig.for_model(**CONFIG)
    specs = param_specs_from_hf_config(hf_config, tensor_model_parallel_size=1)
    plan = build_plan(TrainerLayout(), EngineLayout(tensor_parallel_size=2), specs, bucket_size_mb=16 / 1024)
    return hf_config, plan


def _sender(directory: str) -> dict:
    from megarl.models.families import get_family
    from megarl.weight_sync.copy_instructions import Placement
    from megarl.weight_sync.gather import StageGatherer
    from megarl.weight_sync.manifest_checks import WeightSyncError
    from megarl.weight_sync.p2p import CheckedDistributedTransport

    hf_config, plan = _plan()
    gen = torch.Generator().manual_seed(0)
    local = {t.param.name: torch.randn(t.param.shape, generator=gen) for b in plan.buckets for t in b.params}
    placement = Placement(get_family(hf_config).layout(hf_config, tp_size=1))
    transport = CheckedDistributedTransport(plan, FileEngines(directory, 2), backend="gloo",
                                            master_address="127.0.0.1", timeout_s=60)
    transport.connect(0)
    out = {"sent": {}, "first_tensor": plan.buckets[0].hf_tensors[0].name}
    for corrupt in (False, True):
        if corrupt:  # engine rank 0's buffer is the one broadcast: every rank gets the flipped byte
            transport.tamper = lambda index, rank, buf: _flipped(buf) if index == 0 and rank == 0 else None
        transport.start_sync()
        try:
            for bucket, views, flat in StageGatherer(plan, 0, local, placement).iter_hf_buckets():
                out["sent"].update((name, view.clone()) for name, view in views)
                transport.send(bucket, views, flat)
            transport.drain()
            out["rank_bytes"], out["total_bytes"] = list(transport.stats.engine_rank_bytes), plan.total_bytes
        except WeightSyncError as err:
            out["error"] = str(err)
    transport.close()
    return out


def _flipped(buffer: torch.Tensor) -> torch.Tensor:
    copy = buffer.clone()
    copy[3] ^= 1
    return copy


class RecordingModel:
    """What SGLang's model would load: every ``load_weights`` call's tensors (copies)."""

    def __init__(self) -> None:
        self.loaded: list[dict[str, torch.Tensor]] = []

    def load_weights(self, named) -> None:
        self.loaded.append({name: t.clone() for name, t in named})


def _engine_rank(tp_rank: int, directory: str) -> list:
    import sglang.srt.runtime_context as runtime_context

    _, plan = _plan()
    manifest = {t.name: (tuple(t.shape), t.dtype) for b in plan.buckets for t in b.hf_tensors}
    runtime_context.get_parallel = lambda: SimpleNamespace(tp_rank=tp_rank)
    receiver._manifest = lambda: manifest
    model, seq, deadline = RecordingModel(), 0, time.monotonic() + 150
    while time.monotonic() < deadline:
        path = Path(directory) / f"r{tp_rank}-{seq:05d}"
        if not path.exists():
            time.sleep(0.005)
            continue
        named = pickle.loads(base64.b64decode(path.read_text()))
        seq += 1
        receiver.receive_shards(model, named)
        if wire.decode_ticket(named[0][0])["op"] == "close":
            return model.loaded
    raise TimeoutError(f"engine rank {tp_rank}: no close ticket after request {seq}")


def _worker(rank, world_size, directory):
    return _sender(directory) if rank == 0 else _engine_rank(rank - 1, directory)


@pytest.mark.timeout(240)
def test_checked_distributed_loads_whole_tensors_and_refuses_a_flipped_byte_everywhere(tmp_path):
    from megarl.testing.multiproc import run_ranks

    sender, *engine_ranks = run_ranks(_worker, 3, args=(str(tmp_path),), backend=None, timeout_s=200)
    _, plan = _plan()
    sent = sender["sent"]
    assert sender["rank_bytes"] == [plan.total_bytes] * 2  # counted by each receiver: whole bucket
    for loaded in engine_ranks:
        assert len(loaded) == len(plan.buckets)  # the good sync's buckets, none of the corrupted one
        got = {name: t for call in loaded for name, t in call.items()}
        assert sorted(got) == sorted(t.name for b in plan.buckets for t in b.hf_tensors)
        assert all(torch.equal(got[name], sent[name]) for name in got)
    error = sender["error"]
    assert "checksum mismatch" in error and "bucket 0" in error and sender["first_tensor"] in error
    assert "rank 0" in error and "rank 1" in error, error


class SessionEngines:
    """Two engines whose update session another stage sender holds for its first ``busy`` answers
    (SGLang 0.5.23's refusal text); records every call."""

    def __init__(self, busy: int) -> None:
        self.urls, self.busy, self.calls = ["http://e0", "http://e1"], busy, []

    def __len__(self) -> int:
        return 2

    def submit(self, index, method, *args, **kwargs):
        import json

        from megarl.rollout.client import EngineRequestError

        self.calls.append((index, method))
        future = concurrent.futures.Future()
        if method == "begin_weight_update" and self.busy > 0:
            self.busy -= 1
            body = {"success": False, "message": "a weight-update session is already open; "
                                                 "call end_weight_update() first"}
            future.set_exception(EngineRequestError("/begin_weight_update", 200, json.dumps(body)))
        else:
            future.set_result({"success": True})
        return future

    def submit_all(self, method, *args, **kwargs):
        return [self.submit(i, method, *args, **kwargs) for i in range(2)]

    def call_all(self, method, *args, timeout_s=None, **kwargs):
        return [f.result() for f in self.submit_all(method, *args, **kwargs)]


@pytest.mark.parametrize("busy, closes", [(0, True), (3, True), (10**6, False)])
def test_close_waits_for_another_stage_senders_session_then_closes_the_group(monkeypatch, busy, closes):
    """PP2: both stage senders close at once and SGLang refuses a second open session. close()
    waits its turn (engine by engine) instead of failing, and fails naming the engine when the
    session never frees; either way the local group is destroyed."""
    from megarl.weight_sync import receiver_group
    from megarl.weight_sync.manifest_checks import WeightSyncError
    from megarl.weight_sync.p2p import CheckedDistributedTransport

    _, plan = _plan()
    destroyed = []
    monkeypatch.setattr(receiver_group.dist, "destroy_process_group", destroyed.append)
    engines = SessionEngines(busy)
    transport = CheckedDistributedTransport(plan, engines, backend="gloo", timeout_s=60)
    transport.group, transport.group_name = "group", "g"
    monkeypatch.setattr(receiver_group.time, "monotonic", iter(range(0, 10**7, 10)).__next__ if not closes else time.monotonic)
    monkeypatch.setattr(receiver_group.time, "sleep", lambda s: None)
    if closes:
        transport.close()
        begins = [c for c in engines.calls if c[1] == "begin_weight_update"]
        assert begins == [(0, "begin_weight_update")] * (busy + 1) + [(1, "begin_weight_update")]
        tickets = [c for c in engines.calls if c[1] == "update_weights_from_tensor"]
        assert len(tickets) == 2 and engines.calls[-2:] == [(0, "end_weight_update"), (1, "end_weight_update")]
    else:
        with pytest.raises(WeightSyncError, match=r"engine 0 \(http://e0\) kept another weight-update session"):
            transport.close()
    assert destroyed == ["group"] and transport.group is None
