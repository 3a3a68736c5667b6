"""The Megatron -> HF export at 2 ranks (issue 35 item 3): each rank writes its own shards, one index.

A TP2 dist checkpoint of the tiny Qwen3-MoE (real Megatron-Core, 2 gloo ranks) exported by
``megatron_to_hf_dir`` at 1 and at 2 ranks. References: the single-rank export (the safetensors
library reads both), the original HF weights, and transformers loading the 2-rank folder through its
index; where the ranks' parts meet is read from the files the index names and their sizes.
"""
import json

import pytest
import torch

from megarl.conversion.convert import hf_to_megatron, megatron_to_hf_dir
from megarl.conversion.hf_io import INDEX_FILE
from megarl.testing.checkpoints import load_safetensors_dir

pytestmark = pytest.mark.slow  # ~45 s on 2 shared cores: a TP2 import and four exports


SHARD_BYTES = 40_000
"""Shard size limit of the exports: several files per rank."""


def _assert_same_tensors(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref)
    for name, tensor in ref.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.fixture(scope="module")
def exports(tiny_moe_dir, tmp_path_factory):
    """``{(ranks, dtype): exported dir}`` of one TP2 checkpoint; 40 kB shards: several per rank."""
    work = tmp_path_factory.mktemp("parallel_export")
    ckpt = hf_to_megatron(tiny_moe_dir, work / "ckpt", tensor_model_parallel_size=2, timeout_s=240)
    return {(ranks, dtype): megatron_to_hf_dir(ckpt, work / f"hf_{ranks}_{dtype}", ranks=ranks, dtype=dtype,
                                               max_shard_bytes=SHARD_BYTES, timeout_s=240)
            for ranks in (1, 2) for dtype in ("float32", "bfloat16")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_ranks_export_the_single_rank_tensors(exports, tiny_moe_dir, dtype):
    one, two = load_safetensors_dir(exports[(1, dtype)]), load_safetensors_dir(exports[(2, dtype)])
    _assert_same_tensors(two, one)  # same names, dtypes and bytes as the single-rank export
    original = load_safetensors_dir(tiny_moe_dir)
    if dtype == "float32":
        _assert_same_tensors(two, original)
    else:  # the bf16 export is the original rounded to bf16 (tensors transformers keeps in fp32 aside)
        for name, tensor in original.items():
            assert torch.equal(two[name], tensor.to(two[name].dtype)), name


def _group(name: str) -> str:
    """The export's unit of work an HF tensor belongs to: the embedding, a layer, or the output."""
    if name.startswith("model.layers."):
        return ".".join(name.split(".")[:3])
    return "embedding" if name.startswith("model.embed_tokens.") else "output"


@pytest.mark.timeout(600)
def test_the_ranks_cut_once_at_a_layer_boundary_and_one_index_covers_them(exports):
    """The single-rank export starts a file only when the next tensor would overflow the shard; the
    2-rank one starts exactly one more early, where the second rank's half begins: at a group
    boundary, with half the bytes (up to one group) before it. One index covers every file."""
    out = exports[(2, "float32")]
    weight_map = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    tensors = load_safetensors_dir(out)
    assert sorted(weight_map) == sorted(tensors)
    assert sorted(set(weight_map.values())) == sorted(p.name for p in out.glob("*.safetensors"))
    assert [p.name for p in out.iterdir() if p.name.endswith("index.json")] == [INDEX_FILE]
    single = json.loads((exports[(1, "float32")] / INDEX_FILE).read_text())["weight_map"]
    assert list(weight_map) == list(single), "the tensors in the single-rank export's order"
    size = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    names, early, used = list(weight_map), [], 0
    for prev, name in zip(names, names[1:]):
        used += size[prev]
        if weight_map[name] != weight_map[prev]:
            if used + size[name] <= SHARD_BYTES:
                early.append(name)
            used = 0
    assert len(early) == 1, early
    cut = names.index(early[0])
    assert _group(names[cut]) != _group(names[cut - 1]), "the ranks' parts end at a group boundary"
    groups: dict[str, int] = {}
    for name in names:
        groups[_group(name)] = groups.get(_group(name), 0) + size[name]
    assert abs(sum(size[n] for n in names[:cut]) - sum(size.values()) / 2) <= max(groups.values())


@pytest.mark.timeout(600)
def test_transformers_loads_the_two_rank_folder_as_the_original(exports, tiny_moe_dir):
    """transformers reads the 2-rank folder through its index, every weight found, into the model
    it builds from the original folder (its own layout: transformers 5 fuses the experts)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(exports[(2, "float32")], dtype=torch.float32,
                                                       output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    reference = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).state_dict()
    _assert_same_tensors(model.state_dict(), reference)
