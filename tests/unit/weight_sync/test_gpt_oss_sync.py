"""gpt-oss weight sync on paper and on real tensors, no processes (the engine side: test_load_proof.py).

SGLang 0.5.23 loads a gpt-oss layer's experts only as whole stacks in the checkpoint's ``x @ W``
layout (``Family.engine_load_groups`` of gpt-oss cites the loader). References: transformers'
``GptOssForCausalLM`` (its parameter names and shapes are the checkpoint the engine loads), the
family's own conversion (``megatron_to_hf`` with its mapping table: the stacked HF tensors of full
Megatron tensors), and SGLang's split of a stack over its ranks written out from its loader
(``_load_w13`` / ``_load_w2``: the 2F columns of ``gate_up_proj`` and F rows of ``down_proj`` chunked
by MoE TP rank, the down bias whole).
"""
from __future__ import annotations

import pytest
import torch
from test_owner_parts import _deliver

from megarl.weight_sync.layout import EngineLayout, TrainerLayout

GPT_OSS = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 256,
           "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"], "swiglu_limit": 7.0,
           "attention_bias": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
STACKS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def _plan(trainer: TrainerLayout, engines: EngineLayout, bucket_size_mb: float = 0.01):
    from transformers import AutoConfig

    from megarl.models.families import get_family
    from megarl.weight_sync.copy_instructions import Placement
    from megarl.weight_sync.model_specs import engine_table, param_specs_from_hf_config
    from megarl.weight_sync.plan import build_plan

    specs = param_specs_from_hf_config(GPT_OSS, tensor_model_parallel_size=trainer.tp_size, dtype="bfloat16")
    plan = build_plan(trainer, engines, specs, bucket_size_mb=bucket_size_mb)
    hf_config = AutoConfig.for_model(**{k: v for k, v in GPT_OSS.items() if k != "architectures"})
    family = get_family(hf_config)
    return plan, Placement(family.layout(hf_config, tp_size=trainer.tp_size), engine_table(family, hf_config),
                           family.sync_shard_view)


def _checkpoint_and_shards(plan, placement):
    """``(checkpoint, local)``: the HF tensors the family's conversion makes of random full Megatron
    tensors (experts stacked), and per trainer rank ``{name: its Megatron shard}`` as the trainer holds it."""
    from megarl.models.families import get_family
    from megarl.models.mapping import lookup, megatron_to_hf, split_tp
    from megarl.weight_sync.senders import holders

    table = get_family("gpt_oss").table  # the conversion's own table, not the sync table
    torch.manual_seed(0)
    fulls, local = {}, {r: {} for r in range(plan.trainer_layout.world_size)}
    for bucket in plan.buckets:
        for transfer in bucket.params:
            name, shape = transfer.param.name, transfer.param.shape
            viewed = name.endswith(("linear_fc1.weight", "linear_fc2.weight")) and ".local_experts." in name
            fulls[name] = full = torch.randn(tuple(reversed(shape)) if viewed else shape).bfloat16()
            entry, _ = lookup(table, name)
            for source in transfer.sources:
                shard = split_tp(full, entry.tp_split, source.shard_index, len(transfer.sources)).contiguous()
                for rank in holders(plan, transfer, source):
                    local[rank][name] = shard
    return dict(megatron_to_hf(fulls.items(), placement.layout, table)), local


def _sglang_holds(name: str, stack: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Engine rank ``rank``'s part of a stacked tensor as SGLang's loader narrows it (module docstring)."""
    if name.endswith(("gate_up_proj", "gate_up_proj_bias")):
        return stack.chunk(tp, dim=-1)[rank]
    if name.endswith("down_proj"):
        return stack.chunk(tp, dim=1)[rank]
    return stack  # down_proj_bias: whole


@pytest.mark.parametrize("trainer, engine_tp", [
    (TrainerLayout(tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1,
                   data_parallel_size=2), 2),
    (TrainerLayout(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=2,
                   data_parallel_size=2), 2),
    (TrainerLayout(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=2,
                   data_parallel_size=2), 1),
], ids=["ep4-etp1-engine_tp2", "ep2-etp2-engine_tp2", "ep2-etp2-engine_tp1"])
def test_owner_parts_rebuild_each_engine_ranks_part_of_every_stack(trainer, engine_tp):
    """Every trainer rank cuts its parts from its own shard read through the family's view; each
    engine rank's slices, stacked as the receiver hands them to SGLang, are SGLang's part of the
    stacks the family's conversion makes (a view of the received bytes, no copy)."""
    from megarl.weight_sync.owners import OwnerParts
    from megarl.weight_sync.stacked_experts import stack_expert_slices

    plan, placement = _plan(trainer, EngineLayout(tensor_parallel_size=engine_tp))
    parts = OwnerParts(plan, placement)
    checkpoint, local = _checkpoint_and_shards(plan, placement)
    viewed = {rank: placement.local_view(shards) for rank, shards in local.items()}
    stacked = set()
    for bucket in plan.buckets:
        for rank in range(engine_tp):
            status, at, slices, entry = _deliver(parts, bucket, 0, rank, viewed)
            assert (status, at) == (0, 0), (bucket.index, rank)
            named = [(name, got) for (name, _, _), got in zip(entry["tensors"], slices)]
            for name, got in stack_expert_slices(named, lambda _: 8):
                if "[" in name:
                    continue  # a stack cut by a bucket: test_stacks_stay_whole says it never is
                spec_name = name.rsplit(".", 1)[-1]
                if spec_name in STACKS:
                    stacked.add(name)
                    assert got.data_ptr() == named[[n for n, _ in named].index(name + "[0]")][1].data_ptr()
                    assert torch.equal(got, _sglang_holds(name, checkpoint[name], rank, engine_tp)), (name, rank)
                else:
                    spec = next(t for t in bucket.hf_tensors if t.name == name)
                    sl = plan.engine_slices_of(spec)[rank]
                    ref = checkpoint[name] if sl.axis is None else checkpoint[name].narrow(sl.axis, sl.start,
                                                                                             sl.stop - sl.start)
                    assert torch.equal(got, ref), (name, rank)
    assert len(stacked) == 2 * len(STACKS)


def test_stacks_stay_whole_back_to_back_and_match_the_checkpoint():
    """Buckets of ~one tensor: each stack's 8 slices still share one bucket, back to back in
    expert order; stacked, the plan's tensors are transformers' model's, name, shape and dtype."""
    from transformers import AutoConfig, GptOssForCausalLM

    from megarl.weight_sync.manifest_checks import check_plan_against_manifest

    plan, _ = _plan(TrainerLayout(expert_model_parallel_size=2, data_parallel_size=2),
                    EngineLayout(tensor_parallel_size=2), bucket_size_mb=0.0001)
    where = {}
    for bucket in plan.buckets:
        names = [t.name for t in bucket.hf_tensors]
        for stack in {n.rsplit("[", 1)[0] for n in names if n.endswith("]")}:
            at = names.index(f"{stack}[0]")
            assert names[at:at + 8] == [f"{stack}[{e}]" for e in range(8)], (bucket.index, stack)
            where[stack] = bucket.index
    assert len(where) == 2 * len(STACKS) and len(set(where.values())) == len(where)  # one bucket per stack
    assert len(plan.buckets) > 20  # and boundaries everywhere else
    hf_config = AutoConfig.for_model(**{k: v for k, v in GPT_OSS.items() if k != "architectures"})
    with torch.device("meta"):
        model = GptOssForCausalLM(hf_config).to(torch.bfloat16)
    manifest = {n: (tuple(p.shape), "bfloat16") for n, p in model.state_dict().items()}
    check_plan_against_manifest(plan, manifest)


def test_an_engine_with_expert_parallelism_is_refused_by_name():
    from megarl.weight_sync.engine_slices import PlanError

    plan, _ = _plan(TrainerLayout(), EngineLayout(tensor_parallel_size=2, expert_parallel_size=2))
    spec = next(t for t in plan.hf_tensors() if t.name.endswith("gate_up_proj[3]"))
    with pytest.raises(PlanError, match=r"gate_up_proj\[3\].*weight_loader_fused"):
        plan.engine_slices_of(spec)


def test_stack_expert_slices_views_copies_and_leaves_incomplete_stacks():
    from megarl.weight_sync.stacked_experts import stack_expert_slices

    flat = torch.arange(24.0)
    back_to_back = [("a", flat[:4])] + [(f"s[{e}]", flat[4 + 6 * e:10 + 6 * e].view(2, 3)) for e in range(3)]
    (_, a), (name, got) = stack_expert_slices(back_to_back, lambda _: 3, views_only=True)
    assert name == "s" and got.data_ptr() == flat[4:].data_ptr() and torch.equal(got, flat[4:22].view(3, 2, 3))
    apart = [(f"s[{e}]", torch.full((2,), float(e))) for e in (1, 0, 2)]
    assert torch.equal(stack_expert_slices(apart, lambda _: 3)[0][1], torch.tensor([[0.0] * 2, [1.0] * 2, [2.0] * 2]))
    with pytest.raises(ValueError, match="not back to back"):
        stack_expert_slices(apart, lambda _: 3, views_only=True)
    for incomplete in (apart[:2], apart + apart[:1]):  # a slice missing, a slice twice: SGLang must not get a stack
        assert [n for n, _ in stack_expert_slices(incomplete, lambda _: 3)] == [n for n, _ in incomplete]


def test_the_view_of_each_trainer_shard_is_its_block_of_the_hf_tensor():
    """The sync table reads an ETP shard as one block of the HF slice; reference: the family's
    conversion of the full tensor (``to_hf``), sliced."""
    from megarl.models.families.gpt_oss import FAMILY, LOCAL, TABLE
    from megarl.models.mapping import split_tp, to_hf

    layout = FAMILY.layout(_hf_config())
    for suffix, shape in (("linear_fc1.weight", (64, 16)), ("linear_fc1.bias", (64,)), ("linear_fc2.weight", (16, 32))):
        template = LOCAL + suffix
        name = template.format(L=1, E=5)
        full = torch.randn(shape)
        (hf,) = to_hf(TABLE[template], full, layout)
        axis = 1 if suffix == "linear_fc1.weight" else 0
        shards = [FAMILY.sync_shard_view(name, split_tp(full, TABLE[template].tp_split, k, 4)) for k in range(4)]
        assert torch.equal(torch.cat(shards, dim=axis), hf), suffix


def _hf_config():
    from transformers import AutoConfig

    return AutoConfig.for_model(**{k: v for k, v in GPT_OSS.items() if k != "architectures"})
