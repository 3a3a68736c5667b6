"""FP8 on the wire: what a block-FP8 engine rank receives is its own shard quantised (checked against
the per-block loop reference of ``test_fp8_blocks``), at about half the bytes of the BF16 shard.

The sender side runs for real (conversion through ``StageGatherer``, ``WireQuantizer``, the ``p2p``
transport's per-rank packing and checksums, the receiver's checks against the served checkpoint's
headers); no SGLang engine loads the result (SGLang's CPU FP8 path needs Intel AMX, see
``megarl.weight_sync.fp8_wire``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megarl.models.fp8_blocks import BlockFP8
from megarl.weight_sync import receiver
from megarl.weight_sync.engine_slices import PlanError, engine_slices
from megarl.weight_sync.fp8_wire import check_sglang_version, served_quantization, wire_specs
from megarl.weight_sync.layout import EngineLayout, TrainerLayout
from megarl.weight_sync.manifest_checks import WeightSyncError, check_plan_against_manifest, read_manifest
from megarl.weight_sync.plan import build_plan
from megarl.weight_sync.quantizer import WireQuantizer
from megarl.weight_sync.specs import EngineSplit, HFTensorSpec
from megarl.weight_sync.wire import checksum_algo

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from test_fp8_blocks import _reference_quantize

TP = 2
CONFIG = {"model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 512, "moe_intermediate_size": 256,
          "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 512, "torch_dtype": "bfloat16"}


class _OneEngine:
    """Stands in for the EngineClients where only the packing is exercised (nothing is submitted)."""

    urls = ["http://engine"]

    def __len__(self) -> int:
        return 1


def _rank_shard(name: str, full: torch.Tensor, rank: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Engine rank ``rank``'s part of an HF tensor, by SGLang's layer types (written out here)."""
    module = name.rsplit(".", 2)[-2]
    if module in ("q_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"):
        return full.chunk(TP, 0)[rank]
    if module in ("o_proj", "down_proj"):
        return full.chunk(TP, 1)[rank]
    if module in ("k_proj", "v_proj"):
        if num_kv_heads >= TP:
            return full.chunk(TP, 0)[rank]
        head = rank * num_kv_heads // TP
        return full[head * head_dim:(head + 1) * head_dim]
    return full


def _write_fp8_checkpoint(directory: Path, hf: dict[str, torch.Tensor], quantization: BlockFP8) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for name, tensor in hf.items():
        if quantization.is_quantized(name, tensor.shape):
            tensors[name], tensors[name + "_scale_inv"] = _reference_quantize(tensor, 128, 128)
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(directory / "model.safetensors"))


@pytest.mark.parametrize("num_kv_heads", [2, 1])  # kv heads split over the 2 ranks / replicated
def test_each_engine_rank_receives_its_shard_quantised_at_half_the_bytes(tmp_path, monkeypatch, num_kv_heads):
    from transformers import AutoConfig

    from megarl.models.families import get_family
    from megarl.models.mapping import megatron_to_hf
    from megarl.weight_sync.copy_instructions import Placement
    from megarl.weight_sync.gather import RING_SLOTS, StageGatherer
    from megarl.weight_sync.model_specs import param_specs_from_hf_config
    from megarl.weight_sync.p2p import P2PTransport

    hf_config = AutoConfig.for_model(**dict(CONFIG, num_key_value_heads=num_kv_heads))
    layout = get_family(hf_config).layout(hf_config, tp_size=1)
    specs = param_specs_from_hf_config(hf_config, tensor_model_parallel_size=1)
    quantization = BlockFP8()
    plan = build_plan(TrainerLayout(), EngineLayout(tensor_parallel_size=TP), specs, bucket_size_mb=1,
                      quantization=quantization)
    assert len(plan.buckets) > 1
    gen = torch.Generator().manual_seed(num_kv_heads)
    local = {t.param.name: (torch.randn(t.param.shape, generator=gen) * 0.05).to(torch.bfloat16)
             for b in plan.buckets for t in b.params}
    hf = dict(megatron_to_hf(list(local.items()), layout))

    # The served checkpoint: the plan matches its headers only with FP8 weights and their scales.
    _write_fp8_checkpoint(tmp_path, hf, quantization)
    manifest = read_manifest(tmp_path)
    check_plan_against_manifest(plan, manifest)
    with pytest.raises(WeightSyncError, match=r"dtype bfloat16 planned, engine checkpoint has float8_e4m3fn"):
        check_plan_against_manifest(build_plan(TrainerLayout(), EngineLayout(tensor_parallel_size=TP), specs), manifest)
    monkeypatch.setattr(receiver, "_manifest", lambda: manifest)

    quantizer = WireQuantizer(quantization, [None] * RING_SLOTS)
    transport = P2PTransport(plan, _OneEngine(), backend="gloo")
    received: list[dict[str, torch.Tensor]] = [{} for _ in range(TP)]
    wire_bytes = [0] * TP
    buckets = StageGatherer(plan, 0, local, Placement(layout)).iter_hf_buckets()
    for bucket, tensors, flat in quantizer.wrap(buckets):
        assert flat.numel() == bucket.nbytes == plan.buckets[bucket.index].wire_nbytes
        for name, view in tensors:  # the full tensors (what `distributed` broadcasts) are the checkpoint's
            assert torch.equal(view.view(torch.uint8), manifest_tensor(tmp_path, name).view(torch.uint8)), name
        packed = list(transport._packed(bucket, tensors, flat))  # what dist.isend sends to each rank
        assert all(len(messages) == 1 for _, messages, _ in packed)  # the HF layout: one message per rank
        buffers, listings, algo = [m[0] for _, m, _ in packed], [lst for _, _, lst in packed], checksum_algo(flat.device)
        for rank in range(TP):
            ticket = {"bucket": bucket.index, "algo": algo, "tensors": listings[rank]}
            status, index, named = receiver._check(buffers[rank].clone(), ticket)
            assert status == 0, (rank, listings[rank][index])
            received[rank].update((n, v.clone()) for n, v in named)  # what load_presharded hands SGLang
            wire_bytes[rank] += buffers[rank].numel()
    assert quantizer.quantize_s > 0

    quantized_bf16 = [0] * TP
    quantized_wire = [0] * TP
    for rank in range(TP):
        expected_names = set()
        for name, full in hf.items():
            shard = _rank_shard(name, full, rank, num_kv_heads, 128)
            if quantization.is_quantized(name, full.shape):
                q, scale_inv = _reference_quantize(shard, 128, 128)  # the rank's own shard, quantised
                got_q, got_s = received[rank][name], received[rank][name + "_scale_inv"]
                assert got_q.dtype == torch.float8_e4m3fn and torch.equal(got_q.view(torch.uint8), q.view(torch.uint8)), name
                assert torch.equal(got_s, scale_inv), name
                expected_names |= {name, name + "_scale_inv"}
                quantized_bf16[rank] += shard.numel() * 2
                quantized_wire[rank] += q.numel() + scale_inv.numel() * 4
            else:
                assert torch.equal(received[rank][name], shard), name
                expected_names.add(name)
        assert set(received[rank]) == expected_names
    ratios = [w / b for w, b in zip(quantized_wire, quantized_bf16)]
    assert all(0.5 < r < 0.5 + 4 / 128**2 / 2 + 1e-9 for r in ratios), ratios  # 1 byte + 4 per 128x128 block
    assert wire_bytes == plan.engine_shard_bytes()  # received / shard = 1.00 in the served format
    total_bf16 = sum(t.nbytes for t in plan.hf_tensors()) // TP
    assert max(wire_bytes) < 0.6 * total_bf16  # the bf16 embedding / LM head stay as they are


def manifest_tensor(directory: Path, name: str) -> torch.Tensor:
    from safetensors.torch import load_file

    cache = manifest_tensor.__dict__.setdefault("cache", {})
    if directory not in cache:
        cache.clear()
        cache[directory] = load_file(str(directory / "model.safetensors"))
    return cache[directory][name]


def test_scales_follow_their_weights_split_in_whole_blocks():
    q_proj = HFTensorSpec("model.layers.0.self_attn.q_proj.weight", (512, 256), "bfloat16", EngineSplit.ROWS)
    o_proj = HFTensorSpec("model.layers.0.self_attn.o_proj.weight", (256, 300), "bfloat16", EngineSplit.COLS)
    norm = HFTensorSpec("model.layers.0.input_layernorm.weight", (256,), "bfloat16")
    wire = {t.name: t for t in wire_specs([norm, q_proj, o_proj], BlockFP8())}
    assert [t.dtype for t in wire_specs([norm, q_proj, o_proj], BlockFP8())] == \
        ["float32", "float32", "bfloat16", "float8_e4m3fn", "float8_e4m3fn"]  # aligned wire order
    scale = wire["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert scale.shape == (4, 2)
    slices = engine_slices(scale, EngineLayout(tensor_parallel_size=2), 0)
    assert [(s.axis, s.start, s.stop) for s in (slices[0], slices[1])] == [(0, 0, 2), (0, 2, 4)]
    with pytest.raises(PlanError, match=r"o_proj.weight: an engine rank holds columns \[0, 150\)"):
        engine_slices(wire["model.layers.0.self_attn.o_proj.weight_scale_inv"], EngineLayout(tensor_parallel_size=2), 0)
    coarse = wire_specs([q_proj], BlockFP8(block=(256, 128)))[0]  # 128 rows per rank: half a block
    with pytest.raises(PlanError, match=r"q_proj.weight: an engine rank holds rows \[0, 128\)"):
        engine_slices(coarse, EngineLayout(tensor_parallel_size=4), 0)


def test_served_quantization_from_the_engines_config_and_the_version_guard():
    from transformers import AutoConfig

    qc = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    hf_config = AutoConfig.for_model(**dict(CONFIG, quantization_config=qc))
    assert served_quantization(hf_config) == BlockFP8()
    assert served_quantization(AutoConfig.for_model(**CONFIG)) is None
    with pytest.raises(ValueError, match="served/config.json quantization_config.quant_method='awq'"):
        served_quantization(AutoConfig.for_model(**dict(CONFIG, quantization_config={"quant_method": "awq"})),
                            source="served/config.json")
    check_sglang_version("0.5.23")
    with pytest.raises(RuntimeError, match="found 0.4.0"):
        check_sglang_version("0.4.0")
