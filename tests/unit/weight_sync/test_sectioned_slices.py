"""Qwen3.5's gated DeltaNet at engine TP > 1: each engine rank's slice of a sectioned HF tensor is
one row block per section, and every path that builds slices delivers exactly those rows.

Reference (independent of the plan's slicing code): SGLang's layout written out, engine rank ``r`` of
``T`` holds rows ``start_s + r * n_s / T ... + n_s / T`` of every section ``s`` (``in_proj_qkv`` /
``conv1d``: sections ``[q; k; v]``; ``dt_bias`` / ``A_log``: one), applied to the family mapping's own
``to_hf`` of the unsplit parameter (SGLang's own loader agrees with these rows:
``test_qwen3_5_sync_plan.py::test_sections_are_the_rows_sglangs_loaders_take``). Checked: the owner
senders' parts as the engine's receiver places them, the sliced buckets of segment senders over
gloo (2 ranks), the ``shard`` / ``p2p`` transports' cut of a whole tensor, and that pieces not cut at
the engine's blocks are refused by name instead of misplaced.
"""
from __future__ import annotations

import pytest
import torch
from test_owner_parts import _deliver
from test_qwen3_5_sync_plan import CONFIG  # the same tiny Qwen3.5 config

from megarl.weight_sync.engine_slices import PlanError
from megarl.weight_sync.layout import EngineLayout, TrainerLayout
from megarl.weight_sync.model_specs import param_specs_from_hf_config
from megarl.weight_sync.plan import build_plan

pytestmark = pytest.mark.timeout(300)

SECTIONS = {"in_proj_qkv.weight": (32, 32, 32), "conv1d.weight": (32, 32, 32), "dt_bias": (8,), "A_log": (8,)}
"""Key dim 4 x 8, value dim 8 x 4; 8 value heads (written out from ``CONFIG``)."""


def _expected_rows(name: str, rank: int, size: int) -> torch.Tensor | None:
    """The HF rows engine rank ``rank`` of ``size`` holds of a DeltaNet sectioned tensor; None for others."""
    tail = name.split(".linear_attn.")[-1]
    if ".linear_attn." not in name or tail not in SECTIONS:
        return None
    sections, start, rows = SECTIONS[tail], 0, []
    for n in sections:
        rows.append(torch.arange(start + rank * n // size, start + (rank + 1) * n // size))
        start += n
    return torch.cat(rows)


def _reference(references: dict, plan, spec, rank: int) -> torch.Tensor:
    rows = _expected_rows(spec.name, rank, plan.engine_layout.tp_size)
    if rows is not None:
        return references[spec.name][rows]
    sl = plan.engine_slices_of(spec)[rank]  # the other tensors: single blocks, as every other family's
    return references[spec.name] if sl.axis is None else references[spec.name].narrow(sl.axis, sl.start,
                                                                                       sl.stop - sl.start)


def _plan(trainer: TrainerLayout, engine_tp: int, *, cut: bool = True):
    from transformers import AutoConfig

    from megarl.models.families import get_family
    from megarl.weight_sync.copy_instructions import Placement

    specs = param_specs_from_hf_config(CONFIG, tensor_model_parallel_size=trainer.tp_size)
    plan = build_plan(trainer, EngineLayout(tensor_parallel_size=engine_tp), specs, bucket_size_mb=0.01)
    hf_config = AutoConfig.for_model(**CONFIG)
    layout = get_family(hf_config).layout(hf_config, tp_size=trainer.tp_size)
    return plan, Placement(layout, engine_tp_size=engine_tp if cut else 1)


def _shards(plan, placement):
    """``(references, local)``: per HF tensor the family's ``to_hf`` of the unsplit parameter, and per
    trainer rank ``{name: its shard}`` (``split_tp`` with the model layout: the DeltaNet's sections)."""
    from megarl.models.mapping import lookup, split_tp, to_hf
    from megarl.weight_sync.senders import holders

    gen = torch.Generator().manual_seed(0)
    references, local = {}, {r: {} for r in range(plan.trainer_layout.world_size)}
    for transfer in (t for b in plan.buckets for t in b.params):
        entry, _ = lookup(placement.table, transfer.param.name)
        full = torch.randn(transfer.param.shape, generator=gen)
        references.update(zip((t.name for t in transfer.param.hf), to_hf(entry, full, placement.layout)))
        for source in transfer.sources:
            shard = split_tp(full, entry.tp_split, source.shard_index, len(transfer.sources), placement.layout)
            for rank in holders(plan, transfer, source):
                local[rank][transfer.param.name] = shard.contiguous()
    return references, local


@pytest.mark.parametrize("engine_tp", [2, 4])
def test_each_engine_rank_holds_one_block_per_section(engine_tp):
    plan, _ = _plan(TrainerLayout(tensor_model_parallel_size=2, expert_tensor_parallel_size=1), engine_tp)
    seen = 0
    for spec in plan.hf_tensors():
        for rank, sl in plan.engine_slices_of(spec).items():
            rows = _expected_rows(spec.name, rank, engine_tp)
            if rows is None:
                continue
            seen += 1
            assert len(sl.spans()) == len(SECTIONS[spec.name.split(".linear_attn.")[-1]])
            assert sl.shape(spec.shape) == (rows.numel(),) + spec.shape[1:]
            whole = torch.arange(spec.shape[0])
            assert torch.equal(sl.take(whole), rows), (spec.name, rank)  # what shard / p2p cut from a whole tensor
    assert seen == 4 * engine_tp
    total = sum(t.nbytes for t in plan.hf_tensors())
    assert max(plan.engine_shard_bytes()) < total  # pre-sharded now planned (no PlanError), each rank a part


@pytest.mark.parametrize("trainer_tp, engine_tp", [(1, 2), (2, 2), (2, 4), (4, 2)])
def test_owner_parts_rebuild_each_ranks_section_blocks(trainer_tp, engine_tp):
    from megarl.weight_sync.owners import OwnerParts

    trainer = TrainerLayout(tensor_model_parallel_size=trainer_tp, expert_model_parallel_size=2,
                            expert_tensor_parallel_size=1, data_parallel_size=2 if trainer_tp == 1 else 1)
    plan, placement = _plan(trainer, engine_tp)
    parts = OwnerParts(plan, placement)
    references, local = _shards(plan, placement)
    checked = 0
    for bucket in plan.buckets:
        for rank in range(engine_tp):
            status, at, slices, entry = _deliver(parts, bucket, 0, rank, local)
            assert (status, at) == (0, 0), (bucket.index, rank)
            for (name, _, _), got in zip(entry["tensors"], slices):
                spec = next(t for t in bucket.hf_tensors if t.name == name)
                assert torch.equal(got, _reference(references, plan, spec, rank)), (name, rank)
                checked += _expected_rows(name, rank, engine_tp) is not None
    assert checked == 4 * engine_tp


def test_pieces_across_an_engine_ranks_blocks_are_refused_by_name():
    """A placement built without the engines' TP has pieces spanning several of a rank's blocks
    (trainer TP1: one piece per tensor): refused naming the tensor, never placed in the wrong rows."""
    from megarl.weight_sync.owners import OwnerParts

    plan, placement = _plan(TrainerLayout(), 2, cut=False)
    bucket = next(b for b in plan.buckets if any("in_proj_qkv" in t.name for t in b.hf_tensors))
    with pytest.raises(PlanError, match=r"in_proj_qkv.*engine_tp_size"):
        OwnerParts(plan, placement).parts(bucket, 0, 1)


def _sliced_worker(rank, world_size, owners):
    from megarl.models.mapping import lookup, split_tp
    from megarl.weight_sync.gather import StageGatherer
    from megarl.weight_sync.segments import SegmentOwners

    plan, placement = _plan(TrainerLayout(tensor_model_parallel_size=2, expert_tensor_parallel_size=2), 2)
    gen = torch.Generator().manual_seed(0)
    local = {}
    for transfer in (t for b in plan.buckets for t in b.params):
        full = torch.randn(transfer.param.shape, generator=gen)
        entry, _ = lookup(placement.table, transfer.param.name)
        for source in transfer.sources:
            if source.trainer_rank == rank:
                local[transfer.param.name] = split_tp(full, entry.tp_split, source.shard_index, len(transfer.sources),
                                                      placement.layout)
    seg_owners = None if owners == "none" else SegmentOwners(plan, placement, several=owners == "several")
    gatherer = StageGatherer(plan, rank, local, placement, sliced=True, owners=seg_owners)
    if not gatherer.sends_buckets():
        gatherer.send_contributions()
        return {}
    got = {}
    for _, slices, _ in gatherer.iter_hf_buckets():
        for r, (mine, segment) in enumerate(zip(slices.parts, slices.segments)):
            if segment is not None:
                got.update({(r, name): view.clone() for name, view in mine})
    return got


@pytest.mark.parametrize("owners", ["none", "one", "several"])
def test_a_sliced_bucket_holds_each_ranks_section_blocks(owners):
    """Segment senders (the ``p2p`` transport's sliced buckets), trainer TP2 -> engine TP2 over gloo."""
    from megarl.models.mapping import megatron_to_hf
    from megarl.testing.multiproc import run_ranks

    first, second = run_ranks(_sliced_worker, 2, timeout_s=250, args=(owners,))
    got = {**first, **second}
    plan, placement = _plan(TrainerLayout(tensor_model_parallel_size=2, expert_tensor_parallel_size=2), 2)
    gen = torch.Generator().manual_seed(0)
    full = [(t.param.name, torch.randn(t.param.shape, generator=gen)) for b in plan.buckets for t in b.params]
    from transformers import AutoConfig

    from megarl.models.families import get_family

    hf_config = AutoConfig.for_model(**CONFIG)
    references = dict(megatron_to_hf(full, get_family(hf_config).layout(hf_config, tp_size=1)))
    expected = {(r, spec.name): _reference(references, plan, spec, r)
                for spec in plan.hf_tensors() for r in plan.engine_slices_of(spec)}
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[key], expected[key]) for key in expected), \
        [key for key in expected if not torch.equal(got[key], expected[key])][:4]
