"""Owner senders to block-FP8 engines, on real tensors, no processes: each trainer rank quantises the
parts it holds (``OwnerParts.part_bytes``), the receiver places them from the ticket alone
(``receiver.part_targets`` + ``place_parts``) and quantises the tensors sent unquantised
(``fp8_wire.quantize_listed``); every engine rank's FP8 weights and scales equal, byte for byte, the
whole HF tensor quantised by ``quantize_blockwise`` (what the stage sender's ``WireQuantizer`` sends)
and sliced as SGLang holds it."""
import torch
from test_owner_parts import _deliver, _shards
from test_owner_senders import MLA, _moe_plan

from megarl.models.fp8_blocks import BlockFP8, quantize_blockwise
from megarl.weight_sync.layout import EngineLayout, TrainerLayout
from megarl.weight_sync.plan import build_plan

BLOCK = (8, 8)
"""Small blocks for the toy MLA: q_a_proj's 32 rows split 16 + 16 over trainer TP2 (aligned, quantised
by each holder), kv_a_proj_with_mqa's 24 rows 12 + 12 (off the blocks: the receiver quantises); the
engines' TP2 splits (shared experts' 16 rows: 8 + 8) stay on whole blocks, as SGLang requires."""


def _fp8_plan(trainer, engines):
    from megarl.weight_sync.model_specs import param_specs_from_hf_config

    plan, placement = _moe_plan(trainer, engines, MLA)
    specs = param_specs_from_hf_config(MLA, tensor_model_parallel_size=trainer.tp_size, dtype="bfloat16")
    return build_plan(trainer, engines, specs, bucket_size_mb=0.01, quantization=BlockFP8(block=BLOCK)), placement


def _expected(references, plan, bucket, rank):
    """``{name: tensor}`` engine rank ``rank`` should hold of ``bucket``: each quantised HF tensor
    quantised whole, then its weight and scale sliced by the rank's slices (the stage sender's path)."""
    out = {}
    q = plan.quantization
    for w in bucket.wire:
        sl = plan.engine_slices_of(w).get(rank)
        if sl is None:
            continue
        base = w.scale_of.name if w.scale_of is not None else w.name
        full = references[base]
        if q.is_quantized(base, full.shape):
            full = quantize_blockwise(full, BLOCK)[1 if w.scale_of is not None else 0]
        out[w.name] = full if sl.axis is None else full.narrow(sl.axis, sl.start, sl.stop - sl.start)
    return out


def _within_block_bound(q, scale, reference):
    """The dequantised weight against the trainer's: e4m3 keeps 3 mantissa bits, so each element is
    within half a step of the top binade (16 in units of its block's scale) of the weight, plus the
    fp32 rounding of the division and product (a relative 1e-3 here)."""
    from megarl.models.fp8_blocks import dequantize_blockwise

    error = (dequantize_blockwise(q, scale, BLOCK, dtype=torch.float32) - reference.float()).abs()
    per = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[:q.shape[0], :q.shape[1]]
    return bool((error <= 16 * per * (1 + 1e-3)).all())


def test_owner_fp8_parts_equal_the_whole_tensor_quantised_on_a_split_layout(monkeypatch):
    from megarl.weight_sync import receiver
    from megarl.weight_sync.fp8_wire import quantize_listed
    from megarl.weight_sync.owners import OwnerParts
    from megarl.weight_sync.senders import receiver_quantized

    trainer = TrainerLayout(tensor_model_parallel_size=2, expert_model_parallel_size=4,
                            expert_tensor_parallel_size=1, data_parallel_size=2)
    engines = EngineLayout(tensor_parallel_size=2, num_engines=2)
    plan, placement = _fp8_plan(trainer, engines)
    parts = OwnerParts(plan, placement)
    references, local = _shards(plan, placement)
    # the served checkpoint's headers (what the receiver checks names, dtypes and shapes against)
    monkeypatch.setattr(receiver, "_manifest", lambda: {w.name: (tuple(w.shape), w.dtype)
                                                         for b in plan.buckets for w in b.wire})
    cut: dict[int, int] = {}
    kinds: dict[str, set] = {}
    for bucket in plan.buckets:
        unquantized = receiver_quantized(plan, placement, bucket)
        for engine in range(engines.num_engines):
            for rank in range(engines.tp_size):
                status, at, slices, entry = _deliver(parts, bucket, engine, rank, local)
                assert (status, at) == (0, 0), (bucket.index, engine, rank)
                buffer, tensors = quantize_listed(slices, entry["tensors"], entry.get("quantize", ()))
                assert bool(entry.get("quantize")) == any(n in unquantized for n, *_ in entry["tensors"])
                got, offset = {}, 0
                for name, dtype, shape in tensors:
                    n = torch.Size(shape).numel() * (4 if dtype == "float32" else 2 if dtype == "bfloat16" else 1)
                    got[name] = buffer[offset:offset + n]
                    offset += n
                expected = _expected(references, plan, bucket, rank)
                assert sorted(got) == sorted(expected), (bucket.index, rank)
                for name, ref in expected.items():
                    assert torch.equal(got[name], ref.contiguous().reshape(-1).view(torch.uint8)), (name, rank)
                status, at, named = receiver._check(buffer, {"algo": "xxh3", "tensors": [[*t, None] for t in tensors]})
                assert status == 0, (tensors[at], rank)
                held = dict(named)  # what load_presharded would hand SGLang, against the trainer's weights
                for name, tensor in held.items():
                    if tensor.dtype == torch.float8_e4m3fn:
                        spec = next(t for t in bucket.hf_tensors if t.name == name)
                        sl = plan.engine_slices_of(spec)[rank]
                        ref = references[name] if sl.axis is None else references[name].narrow(
                            sl.axis, sl.start, sl.stop - sl.start)
                        assert _within_block_bound(tensor, held[name + "_scale_inv"], ref), (name, rank)
                for part in parts.parts(bucket, engine, rank):
                    cut[part.sender] = cut.get(part.sender, 0) + part.nbytes
                    kinds.setdefault(part.kind, set()).add(part.name)
    assert cut == parts.sends.sent  # the plan's bytes per trainer rank are what is cut
    q_a = "decoder.layers.0.self_attention.linear_q_down_proj.weight"
    assert q_a in kinds["fp8"] and q_a in kinds["scale"]  # a TP-split FP8 tensor quantised by its holders
    assert any("linear_kv_down_proj" in n for n in kinds["raw"])  # off the blocks: the receiver quantises
    assert any(".experts." in n for n in kinds["fp8"])  # whole experts quantised by their EP owner
