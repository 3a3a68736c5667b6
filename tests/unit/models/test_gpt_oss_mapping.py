"""gpt-oss family: Megatron config from config.json, mapping shapes vs the real checkpoint, the
stacked-expert layout (one expert's slice read from disk, the export stacking them again), the
experts' math after conversion, and refused or mismatched configs.

References: the tiny model's config.json and safetensors (written by transformers, read with the
safetensors library), transformers' own ``GptOssExperts`` forward for one expert, and Megatron's
``MLP`` GLU (``megatron/core/transformer/mlp.py``: ``activation_func(clamp(gate, max=c)) *
(clamp(up, -c, c) + glu_linear_offset)``) written out in the test.
"""
import json

import pytest
import torch

from megarl.config.schema import ModelConfig, ParallelConfig
from megarl.conversion.config_check import ConfigMismatchError, check_weights_match_config, expected_hf_shapes
from megarl.conversion.hf_io import HFCheckpointReader
from megarl.models.families import get_family
from megarl.models.mapping import lookup, megatron_to_hf, to_megatron
from megarl.testing.checkpoints import edited_hf_dir


def _config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)



def _safetensors(hf_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(hf_dir / "model.safetensors"))


@pytest.mark.timeout(60)
def test_megatron_config_follows_config_json(tiny_gpt_oss_dir):
    from megatron.core.activations import quick_gelu

    from megarl.training.model import build_transformer_config

    raw = json.loads((tiny_gpt_oss_dir / "config.json").read_text())
    cfg = build_transformer_config(tiny_gpt_oss_dir, ParallelConfig(), ModelConfig())
    assert cfg.softmax_type == "learnable" and cfg.add_bias_linear and cfg.add_qkv_bias
    assert cfg.window_size == (raw["sliding_window"] - 1, 0)
    # Megatron: a layer is windowed when window_attn_skip_freq[layer_number - 1] is true
    assert [bool(x) for x in cfg.window_attn_skip_freq] == [t == "sliding_attention" for t in raw["layer_types"]]
    assert cfg.activation_func is quick_gelu and raw["swiglu_alpha"] == 1.702
    assert cfg.activation_func_clamp_value == raw["swiglu_limit"] and cfg.glu_linear_offset == 1.0
    assert cfg.num_moe_experts == raw["num_local_experts"] and cfg.moe_ffn_hidden_size == raw["intermediate_size"]
    assert cfg.moe_router_topk == raw["num_experts_per_tok"] and not cfg.moe_router_pre_softmax
    rope = raw["rope_parameters"]
    assert cfg.yarn_rotary_scaling_factor == rope["factor"]
    assert cfg.yarn_original_max_position_embeddings == rope["original_max_position_embeddings"]
    assert cfg.yarn_correction_range_round_to_int is rope["truncate"] is False
    family = get_family("gpt_oss")
    gpt = family.gpt_model_kwargs(family.architecture(_config(tiny_gpt_oss_dir)))
    assert gpt["position_embedding_type"] == "yarn" and gpt["rotary_base"] == rope["rope_theta"]


@pytest.mark.timeout(60)
def test_expected_shapes_match_real_checkpoint_and_slices_read_rows(tiny_gpt_oss_dir):
    reader = HFCheckpointReader(tiny_gpt_oss_dir)
    assert expected_hf_shapes(_config(tiny_gpt_oss_dir)) == {k: reader.shape(k) for k in reader.keys()}
    check_weights_match_config(tiny_gpt_oss_dir)
    stored = _safetensors(tiny_gpt_oss_dir)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    for expert in (0, 5, 7):
        assert torch.equal(reader.get(f"{name}[{expert}]"), stored[name][expert])
    assert f"{name}[8]" not in reader and f"{name}[7]" in reader


def _megatron_experts(hf_dir, layer: int) -> dict[str, torch.Tensor]:
    """Every expert parameter of one layer, converted from the checkpoint (global names)."""
    family = get_family("gpt_oss")
    cfg = _config(hf_dir)
    layout = family.layout(cfg)
    reader = HFCheckpointReader(hf_dir)
    out = {}
    for name in family.megatron_shapes(family.architecture(cfg)):
        if name.startswith(f"decoder.layers.{layer}.mlp.experts."):
            entry, values = lookup(family.table, name)
            out[name] = to_megatron(entry, [reader.get(t.format(**values)) for t in entry.hf], layout)
    return out


@pytest.mark.timeout(60)
def test_converted_expert_computes_what_transformers_computes(tiny_gpt_oss_dir):
    from megatron.core.activations import quick_gelu
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_gpt_oss_dir, dtype=torch.float32)
    experts, limit = model.model.layers[1].mlp.experts, model.config.swiglu_limit
    params = _megatron_experts(tiny_gpt_oss_dir, 1)
    x = 80.0 * torch.randn(16, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for e in range(model.config.num_local_experts):
        ref = experts(x, torch.full((16, 1), e), torch.ones(16, 1))  # routed to e with weight 1
        p = f"decoder.layers.1.mlp.experts.local_experts.{e}."
        h = x @ params[p + "linear_fc1.weight"].t() + params[p + "linear_fc1.bias"]
        gate, up = h.chunk(2, dim=-1)
        h = quick_gelu(gate.clamp(max=limit)) * (up.clamp(-limit, limit) + 1.0)
        out = h @ params[p + "linear_fc2.weight"].t() + params[p + "linear_fc2.bias"]
        assert (gate > limit).any() and (up.abs() > limit).any()  # the clamps are exercised
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
def test_export_stacks_the_experts_back(tiny_gpt_oss_dir):
    family = get_family("gpt_oss")
    layout = family.layout(_config(tiny_gpt_oss_dir))
    params = _megatron_experts(tiny_gpt_oss_dir, 0)
    stored = _safetensors(tiny_gpt_oss_dir)
    out = dict(megatron_to_hf(reversed(list(params.items())), layout))  # any order
    prefix = "model.layers.0.mlp.experts."
    assert sorted(out) == sorted(k for k in stored if k.startswith(prefix))
    for name, tensor in out.items():
        assert torch.equal(tensor, stored[name]), name
    one = dict(megatron_to_hf([next(iter(params.items()))], layout))  # an incomplete stack: the slice
    assert list(one) == [prefix + "gate_up_proj[0]"] and torch.equal(one[prefix + "gate_up_proj[0]"],
                                                                     stored[prefix + "gate_up_proj"][0])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field,value,message", [
    ("quantization_config", {"quant_method": "mxfp4", "modules_to_not_convert": []},
     "quantization_config.quant_method='mxfp4'"),
    ("swiglu_alpha", 1.5, "swiglu_alpha=1.5"),
    ("attention_bias", False, "attention_bias=False"),
    ("layer_types", ["sliding_attention", "chunked_attention"], "layer_types=\\['chunked_attention'\\]"),
])
def test_unsupported_settings_are_refused(tiny_gpt_oss_dir, tmp_path, field, value, message):
    edited = edited_hf_dir(tiny_gpt_oss_dir, tmp_path / "edited", **{field: value})
    with pytest.raises(ValueError, match=message):
        get_family("gpt_oss").architecture(_config(edited))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field,value,message", [
    ("num_local_experts", 4, "num_experts"),
    ("intermediate_size", 16, "model.layers.0.mlp.experts.gate_up_proj: shape"),
    ("num_attention_heads", 8, "model.layers.0.self_attn"),
])
def test_mismatched_config_is_refused(tiny_gpt_oss_dir, tmp_path, field, value, message):
    edited = edited_hf_dir(tiny_gpt_oss_dir, tmp_path / "edited", **{field: value})
    with pytest.raises(ConfigMismatchError, match=message):
        check_weights_match_config(edited)


@pytest.mark.timeout(60)
def test_expert_tensor_parallelism_is_refused_naming_the_field(tiny_gpt_oss_dir):
    from megarl.training.model import build_transformer_config

    for etp in (None, 2):  # None: expert TP defaults to TP (2)
        parallel = ParallelConfig(tensor_model_parallel_size=2, expert_tensor_parallel_size=etp, sequence_parallel=True)
        with pytest.raises(ValueError, match="parallel.expert_tensor_parallel_size: 2 .*expert TP 1"):
            build_transformer_config(tiny_gpt_oss_dir, parallel, ModelConfig())
    parallel = ParallelConfig(tensor_model_parallel_size=2, expert_tensor_parallel_size=1, sequence_parallel=True)
    assert build_transformer_config(tiny_gpt_oss_dir, parallel, ModelConfig()).expert_tensor_parallel_size == 1
