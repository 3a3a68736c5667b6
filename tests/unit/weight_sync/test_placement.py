"""The copy instructions reproduce the family mapping's own conversion (gather_tp + megatron_to_hf),
for every parameter kind of the tiny Qwen3-MoE, dense Qwen3 and Qwen3.5-MoE (gated attention's
``[q; gate]`` heads, the gated DeltaNet's sectioned ``in_proj`` / ``conv1d``) at TP 1, 2 and 4."""
import pytest
import torch

from megarl.models.families import get_family
from megarl.models.mapping import gather_tp, lookup, megatron_to_hf, split_tp
from megarl.weight_sync.copy_instructions import Placement
from megarl.weight_sync.layout import EngineLayout, TrainerLayout
from megarl.weight_sync.model_specs import param_specs_from_hf_config
from megarl.weight_sync.plan import build_plan

CONFIGS = {
    "qwen3_moe": {"model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 8,
                  "num_key_value_heads": 4, "head_dim": 8, "intermediate_size": 64, "moe_intermediate_size": 16,
                  "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 1000, "torch_dtype": "float32"},
    "qwen3": {"model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 8, "intermediate_size": 48, "vocab_size": 1000,
              "tie_word_embeddings": True, "torch_dtype": "float32"},
    "qwen3_5_moe": {"model_type": "qwen3_5_moe_text", "hidden_size": 32, "num_hidden_layers": 2,
                    "layer_types": ["linear_attention", "full_attention"], "num_attention_heads": 8,
                    "num_key_value_heads": 4, "head_dim": 8, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
                    "linear_key_head_dim": 8, "linear_value_head_dim": 4, "linear_conv_kernel_dim": 4,
                    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "num_experts": 4,
                    "num_experts_per_tok": 2, "vocab_size": 1000, "torch_dtype": "float32"},
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_pieces_rebuild_the_mappings_hf_tensors(family, tp):
    from transformers import AutoConfig

    hf_config = AutoConfig.for_model(**CONFIGS[family])
    fam = get_family(hf_config)
    layout = fam.layout(hf_config, tp_size=tp)
    specs = param_specs_from_hf_config(hf_config, tensor_model_parallel_size=tp)
    plan = build_plan(TrainerLayout(tensor_model_parallel_size=tp, expert_tensor_parallel_size=tp), EngineLayout(), specs)
    placement = Placement(layout)
    gen = torch.Generator().manual_seed(0)
    for transfer in (t for b in plan.buckets for t in b.params):
        entry, _ = lookup(fam.table, transfer.param.name)
        full = torch.randn(transfer.param.shape, generator=gen)
        shards = [split_tp(full, entry.tp_split, s.shard_index, len(transfer.sources), layout) for s in transfer.sources]
        expected = dict(megatron_to_hf([(transfer.param.name, gather_tp(shards, entry.tp_split, layout))], layout))
        rebuilt = [torch.full(t.shape, float("nan")) for t in transfer.param.hf]
        for piece in placement.pieces(transfer):
            n = piece.dst[1] - piece.dst[0]
            rebuilt[piece.hf_index].narrow(piece.axis, piece.dst[0], n).copy_(
                shards[piece.shard].narrow(piece.axis, piece.src[0], n))
        assert [t.name for t in transfer.param.hf] == list(expected)
        for t, tensor in zip(transfer.param.hf, rebuilt):
            assert torch.equal(tensor, expected[t.name]), (transfer.param.name, t.name)


def test_gatherer_reuses_its_ring_across_syncs_and_stays_correct():
    """TP1 sender (no peers): two syncs through one ring write every HF tensor as the family mapping
    converts it, the second into the same buffers (no fresh bucket memory on CPU)."""
    from transformers import AutoConfig

    from megarl.weight_sync.gather import RING_SLOTS, StageGatherer

    hf_config = AutoConfig.for_model(**CONFIGS["qwen3_moe"])
    fam = get_family(hf_config)
    layout = fam.layout(hf_config, tp_size=1)
    specs = param_specs_from_hf_config(hf_config, tensor_model_parallel_size=1)
    plan = build_plan(TrainerLayout(), EngineLayout(), specs, bucket_size_mb=16 / 1024)
    assert len(plan.buckets) > RING_SLOTS  # slots are reused within a sync too
    ring = [None] * RING_SLOTS
    pointers = []
    for seed in (0, 1):
        gen = torch.Generator().manual_seed(seed)
        local = {t.param.name: torch.randn(t.param.shape, generator=gen) for b in plan.buckets for t in b.params}
        expected = dict(megatron_to_hf(list(local.items()), layout))
        got = {}
        for _, views, flat in StageGatherer(plan, 0, local, Placement(layout), ring=ring).iter_hf_buckets():
            got.update((name, view.clone()) for name, view in views)
            pointers.append(flat.data_ptr())
        assert sorted(got) == sorted(expected)
        assert all(torch.equal(got[name], expected[name]) for name in expected)
        assert all(slot is not None for slot in ring), "the caller's ring is filled in place"
    first, second = pointers[:len(pointers) // 2], pointers[len(pointers) // 2:]
    assert first == second and len(set(first)) <= RING_SLOTS
    with pytest.raises(ValueError, match="slots"):
        StageGatherer(plan, 0, local, Placement(layout), ring=[None])


def _tp2_gather_worker(rank, world_size):
    from transformers import AutoConfig

    from megarl.weight_sync.gather import StageGatherer

    hf_config = AutoConfig.for_model(**CONFIGS["qwen3_moe"])
    fam = get_family(hf_config)
    layout = fam.layout(hf_config, tp_size=2)
    specs = param_specs_from_hf_config(hf_config, tensor_model_parallel_size=2)
    plan = build_plan(TrainerLayout(tensor_model_parallel_size=2, expert_tensor_parallel_size=2), EngineLayout(),
                      specs, bucket_size_mb=16 / 1024)
    gen = torch.Generator().manual_seed(0)
    local = {}
    for transfer in (t for b in plan.buckets for t in b.params):
        full = torch.randn(transfer.param.shape, generator=gen)  # same on both ranks (same seed and order)
        entry, _ = lookup(fam.table, transfer.param.name)
        for source in transfer.sources:
            if source.trainer_rank == rank:
                local[transfer.param.name] = split_tp(full, entry.tp_split, source.shard_index, len(transfer.sources))
    gatherer = StageGatherer(plan, rank, local, Placement(layout))
    if not any(b.sender_rank == rank for b in plan.buckets):
        return {"sent_bytes": gatherer.send_contributions()}
    return {name: view.clone() for _, views, _ in gatherer.iter_hf_buckets() for name, view in views}


@pytest.mark.timeout(240)
def test_a_tp2_sender_gathers_its_peers_shards_over_gloo_into_the_mappings_hf_tensors():
    """Rank 1's shards reach rank 0's buckets through megarl.training.collectives' isend / irecv;
    reference: the family mapping applied to the unsplit parameters."""
    from transformers import AutoConfig

    from megarl.testing.multiproc import run_ranks

    got, peer = run_ranks(_tp2_gather_worker, 2, timeout_s=200)
    hf_config = AutoConfig.for_model(**CONFIGS["qwen3_moe"])
    specs = param_specs_from_hf_config(hf_config, tensor_model_parallel_size=2)
    gen = torch.Generator().manual_seed(0)
    plan = build_plan(TrainerLayout(tensor_model_parallel_size=2, expert_tensor_parallel_size=2), EngineLayout(),
                      specs, bucket_size_mb=16 / 1024)
    full = [(t.param.name, torch.randn(t.param.shape, generator=gen)) for b in plan.buckets for t in b.params]
    expected = dict(megatron_to_hf(full, get_family(hf_config).layout(hf_config, tp_size=1)))
    assert peer["sent_bytes"] > 0 and sorted(got) == sorted(expected)
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def _sliced_gather_worker(rank, world_size, engine_tp, engine_ep, owners):
    from transformers import AutoConfig

    from megarl.weight_sync.gather import StageGatherer
    from megarl.weight_sync.segments import RankSlices, SegmentOwners

    hf_config = AutoConfig.for_model(**dict(CONFIGS["qwen3_moe"], vocab_size=1024))
    fam = get_family(hf_config)
    layout = fam.layout(hf_config, tp_size=2)
    specs = param_specs_from_hf_config(hf_config, tensor_model_parallel_size=2)
    plan = build_plan(TrainerLayout(tensor_model_parallel_size=2, expert_tensor_parallel_size=2),
                      EngineLayout(tensor_parallel_size=engine_tp, expert_parallel_size=engine_ep), specs,
                      bucket_size_mb=16 / 1024)
    gen = torch.Generator().manual_seed(0)
    local = {}
    for transfer in (t for b in plan.buckets for t in b.params):
        full = torch.randn(transfer.param.shape, generator=gen)
        entry, _ = lookup(fam.table, transfer.param.name)
        for source in transfer.sources:
            if source.trainer_rank == rank:
                local[transfer.param.name] = split_tp(full, entry.tp_split, source.shard_index, len(transfer.sources))
    seg_owners = None if owners == "none" else SegmentOwners(plan, Placement(layout), several=owners == "several")
    gatherer = StageGatherer(plan, rank, local, Placement(layout), sliced=True, owners=seg_owners)
    if not gatherer.sends_buckets():
        return {"sent_bytes": gatherer.send_contributions(), "got": {}, "from_params": 0}
    got, from_params = {}, 0
    for bucket, slices, flat in gatherer.iter_hf_buckets():
        assert isinstance(slices, RankSlices)
        for r, (mine, segment) in enumerate(zip(slices.parts, slices.segments)):
            if segment is None:  # assembled by the other rank
                continue
            messages = slices.messages[r]
            if seg_owners is not None:  # what the stage ticket announces
                assert [int(m.numel()) for m in messages] == seg_owners.message_sizes(bucket)[r]
            joined = torch.cat(messages) if messages else torch.empty(0, dtype=torch.uint8)
            offset = 0
            for name, view in mine:  # each rank's segment: its slices back to back, in order
                n = view.numel() * view.element_size()
                assert torch.equal(joined[offset:offset + n], view.reshape(-1).view(torch.uint8))
                if seg_owners is None:
                    assert view.data_ptr() == segment.data_ptr() + offset
                offset += n
                got[(r, name)] = view.clone()
            assert offset == segment.numel() == joined.numel()
            inside = range(flat.data_ptr(), flat.data_ptr() + flat.numel())
            from_params += sum(1 for m in messages if m.numel() and m.data_ptr() not in inside)
    return {"got": got, "sent_bytes": gatherer.timings.bytes_received, "from_params": from_params}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine_tp,engine_ep,owners", [
    (1, 1, "none"), (2, 1, "none"), (4, 1, "none"), (8, 1, "none"), (2, 2, "none"), (4, 4, "none"),
    (2, 1, "one"), (4, 4, "one"), (1, 1, "several"), (2, 1, "several"), (4, 1, "several"), (8, 1, "several"),
    (4, 4, "several")])
def test_a_sliced_bucket_holds_each_engine_ranks_slices_of_the_mappings_hf_tensors(engine_tp, engine_ep, owners):
    """TP2 trainer, buckets laid out per engine rank (the p2p transport's, no packing copy): engine
    rank r's segment holds exactly its slices (the plan's ``engine_slices_of``) of the family
    mapping's HF tensors of the unsplit parameters; engine TP 8 replicates the 4 kv heads, EP moves
    whole experts to one rank. ``owners``: ``none``: every segment in the stage sender's buffer;
    ``one``: the stage sender's own contiguous slices travel from its parameters (the messages
    :class:`SegmentOwners` announces); ``several``: each segment assembled by the trainer rank
    holding most of it (several senders per stage): every segment exactly once over both ranks,
    some messages straight from the parameters, and at engine
    TP >= 2 trainer rank 1 assembles segments of the second half of the TP group only, and over 90%
    of their bytes."""
    from transformers import AutoConfig

    from megarl.testing.multiproc import run_ranks

    first, second = run_ranks(_sliced_gather_worker, 2, timeout_s=250, args=(engine_tp, engine_ep, owners))
    assert not set(first["got"]) & set(second["got"])  # each segment assembled once
    got = {**first["got"], **second["got"]}
    peer = second
    if owners != "none":
        assert first["from_params"] + second["from_params"] > 0
    if owners == "several" and engine_tp > 1 and engine_ep == 1:  # (EP: each whole expert ties between the ETP ranks)
        assert second["got"] and all(r >= engine_tp // 2 for r, _ in second["got"]), sorted(second["got"])[:4]
        upper = [v for (r, _), v in got.items() if r >= engine_tp // 2]
        mine = sum(v.numel() for v in second["got"].values())
        assert mine > 0.9 * sum(v.numel() for v in upper)  # all but the replicated norms and routers
    hf_config = AutoConfig.for_model(**dict(CONFIGS["qwen3_moe"], vocab_size=1024))
    specs = param_specs_from_hf_config(hf_config, tensor_model_parallel_size=2)
    plan = build_plan(TrainerLayout(tensor_model_parallel_size=2, expert_tensor_parallel_size=2),
                      EngineLayout(tensor_parallel_size=engine_tp, expert_parallel_size=engine_ep), specs,
                      bucket_size_mb=16 / 1024)
    gen = torch.Generator().manual_seed(0)
    full = [(t.param.name, torch.randn(t.param.shape, generator=gen)) for b in plan.buckets for t in b.params]
    hf = dict(megatron_to_hf(full, get_family(hf_config).layout(hf_config, tp_size=1)))
    expected = {}
    for spec in (t for b in plan.buckets for t in b.hf_tensors):
        for r, sl in plan.engine_slices_of(spec).items():
            tensor = hf[spec.name]
            expected[(r, spec.name)] = tensor if sl.axis is None else tensor.narrow(sl.axis, sl.start, sl.stop - sl.start)
    assert (peer["sent_bytes"] > 0 or owners == "several") and sorted(got) == sorted(expected)
    assert all(torch.equal(got[key], expected[key]) for key in expected)


@pytest.mark.parametrize("sliced", [False, True])
def test_a_bucket_with_an_fp32_router_bias_among_bf16_tensors_is_placed_by_name(tiny_deepseek_v3_dir, sliced):
    """Tiny DeepSeek-V3 in bf16: Megatron keeps the router's expert bias in fp32, so the wire order
    (larger elements first) moves it ahead of the bf16 tensors of its bucket; every HF tensor must
    still hold what the family mapping converts (TP1 sender; the HF layout and, sliced, engine TP2's
    per-rank slices)."""
    from megarl.training.model import load_hf_config
    from megarl.weight_sync.gather import StageGatherer
    from megarl.weight_sync.specs import torch_dtype

    hf_config = load_hf_config(str(tiny_deepseek_v3_dir))
    layout = get_family(hf_config).layout(hf_config, tp_size=1)
    specs = param_specs_from_hf_config(hf_config, tensor_model_parallel_size=1, dtype="bfloat16")
    engine = EngineLayout(tensor_parallel_size=2 if sliced else 1)
    plan = build_plan(TrainerLayout(), engine, specs, bucket_size_mb=1)
    reordered = [b for b in plan.buckets
                 if [h.name for t in b.params for h in t.param.hf] != [h.name for h in b.hf_tensors]]
    assert reordered, "no bucket mixes fp32 and bf16 tensors: the case is not exercised"
    gen = torch.Generator().manual_seed(0)
    local = {t.param.name: torch.randn(t.param.shape, generator=gen).to(torch_dtype(t.param.dtype))
             for b in plan.buckets for t in b.params}
    expected = dict(megatron_to_hf(list(local.items()), layout))
    got = {}
    for _bucket, tensors, _ in StageGatherer(plan, 0, local, Placement(layout), sliced=sliced).iter_hf_buckets():
        if sliced:
            for r, mine in enumerate(tensors.parts):
                got.update(((r, name), view.clone()) for name, view in mine)
        else:
            got.update((name, view.clone()) for name, view in tensors)
    if sliced:
        want = {}
        for spec in (t for b in plan.buckets for t in b.hf_tensors):
            for r, sl in plan.engine_slices_of(spec).items():
                full = expected[spec.name]
                want[(r, spec.name)] = full if sl.axis is None else full.narrow(sl.axis, sl.start, sl.stop - sl.start)
        expected = want
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], expected[k].to(got[k].dtype)) for k in expected)
