"""Stop a conversion when an HF ``config.json`` disagrees with the weights or with another config.

Errors name the config field, both values and the file(s), e.g.
``num_hidden_layers: 3 in /m/config.json, but the weights in /m have 2 layers``.
"""
from __future__ import annotations

import os
from pathlib import Path

from megarl.conversion.hf_io import HFCheckpointReader
from megarl.errors import UserError

COMPARED_FIELDS = (
    "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "norm_topk_prob", "moe_layers", "rope_theta", "rope_type",
    "rms_norm_eps", "tie_word_embeddings",
)
"""Architecture fields compared between two configs (after reading either HF spelling)."""


class ConfigMismatchError(UserError):
    """An HF config disagrees with the weights, the checkpoint or another config."""


def compare_configs(expected, actual, *, expected_file: str | os.PathLike,
                    actual_file: str | os.PathLike) -> None:
    """Compare two HF configs field by field (both spellings accepted).

    Raises:
        ConfigMismatchError: the first differing field, with both values and both files.
        ValueError: the model families differ.
    """
    from megarl.models.families import get_family

    if expected.model_type != actual.model_type:
        raise ConfigMismatchError(f"model_type: {expected.model_type!r} in {expected_file} vs "
                                  f"{actual.model_type!r} in {actual_file}")
    family = get_family(expected)
    a, b = family.architecture(expected), family.architecture(actual)
    for field in COMPARED_FIELDS:
        if a.get(field) != b.get(field):
            raise ConfigMismatchError(f"{field}: {a.get(field)!r} in {expected_file} vs "
                                      f"{b.get(field)!r} in {actual_file}")


def _mismatch(field: str, config_value, weights_value, config_file: Path, what: str) -> ConfigMismatchError:
    return ConfigMismatchError(f"{field}: {config_value!r} in {config_file}, but the weights in "
                               f"{config_file.parent} have {weights_value!r} {what}")


def check_weights_match_config(hf_dir: str | os.PathLike, hf_config=None,
                               reader: HFCheckpointReader | None = None) -> None:
    """Check an HF directory's ``config.json`` against its safetensors headers (no data read).

    Counts layers and experts, reads hidden/vocab sizes from the embedding, checks the presence of
    ``lm_head.weight`` against ``tie_word_embeddings`` and compares every expected tensor shape.

    Raises:
        ConfigMismatchError: names the field, the config value, the weights' value and the file.
        CheckpointFileError: missing or truncated shards.
    """
    from megarl.models.families import get_family
    from megarl.training.model import load_hf_config

    hf_dir = Path(hf_dir)
    config_file = hf_dir / "config.json"
    hf_config = hf_config or load_hf_config(hf_dir)
    reader = reader or HFCheckpointReader(hf_dir)
    family = get_family(hf_config)
    arch = family.architecture(hf_config)
    keys = reader.keys()
    pre = family.hf_prefix  # the language model's tensors in a vision-language checkpoint
    layers = {int(k[len(pre):].split(".")[2]) for k in keys if k.startswith(pre + "model.layers.")}
    # Multi-token-prediction layers (DeepSeek-V3, GLM-4.5) follow the decoder layers; not imported.
    layers -= set(range(arch["num_hidden_layers"], arch["num_hidden_layers"] + arch.get("num_mtp_layers", 0)))
    if len(layers) != arch["num_hidden_layers"]:
        raise _mismatch("num_hidden_layers", arch["num_hidden_layers"], len(layers), config_file, "layers")
    vocab, hidden = reader.shape(pre + "model.embed_tokens.weight")
    if hidden != arch["hidden_size"]:
        raise _mismatch("hidden_size", arch["hidden_size"], hidden, config_file, "(embedding columns)")
    if vocab != arch["vocab_size"]:
        raise _mismatch("vocab_size", arch["vocab_size"], vocab, config_file, "(embedding rows)")
    if not arch["tie_word_embeddings"] and pre + "lm_head.weight" not in reader:
        raise _mismatch("tie_word_embeddings", False, "no lm_head.weight", config_file, "(tied?)")
    if arch.get("num_experts"):
        moe_layer = next(i for i, m in enumerate(arch["moe_layers"]) if m)
        # the experts' HF module from the table (``mlp.experts.``; MiniMax-M2: ``block_sparse_moe.experts.``)
        template = next(t for e in family.table.values() if e.expert for t in e.hf)
        prefix = template[:template.index("experts.") + len("experts.")].format(L=moe_layer)
        heads = {k[len(prefix):].split(".")[0] for k in keys if k.startswith(prefix)}
        # per-expert tensors (experts.E.*), else one tensor stacking the experts (gpt-oss)
        experts = len({h for h in heads if h.isdigit()}) or max((reader.shape(prefix + h)[0] for h in heads), default=0)
        if experts != arch["num_experts"]:
            raise _mismatch("num_experts", arch["num_experts"], experts, config_file,
                            f"experts in layer {moe_layer}")
    for name, shape in expected_hf_shapes(hf_config).items():
        if name not in reader:
            raise ConfigMismatchError(f"{config_file} implies tensor {name} of shape {shape}, which is "
                                      f"missing from the weights in {hf_dir}")
        if reader.shape(name) != shape:
            raise ConfigMismatchError(
                f"{name}: shape {shape} implied by {config_file} ({_fields_for(name)}) but "
                f"{reader.shape(name)} in the weights of {hf_dir}")


def _fields_for(hf_name: str) -> str:
    hints = {"q_proj": "num_attention_heads x head_dim, hidden_size",
             "k_proj": "num_key_value_heads x head_dim, hidden_size",
             "v_proj": "num_key_value_heads x head_dim, hidden_size",
             "o_proj": "hidden_size, num_attention_heads x head_dim", "_norm": "head_dim",
             "mlp.gate.": "num_experts, hidden_size", "experts": "moe_intermediate_size, hidden_size",
             "mlp.": "intermediate_size, hidden_size"}
    return next((v for k, v in hints.items() if k in hf_name), "hidden_size")


def expected_hf_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape implied by a config, derived through the family table on meta
    tensors (no Megatron model is built)."""
    import torch

    from megarl.models.families import get_family
    from megarl.models.mapping import Transform, hf_names_for, lookup, stack_shapes, to_hf

    family = get_family(hf_config)
    layout = family.layout(hf_config)
    arch = family.architecture(hf_config)
    shapes = {}
    for name, shape in family.megatron_shapes(arch).items():
        entry, _ = lookup(family.table, name)
        meta = torch.empty(shape, device="meta")
        if entry.transform is Transform.VOCAB:
            meta = torch.empty((layout.padded_vocab_size, shape[1]), device="meta")
        for hf_name, t in zip(hf_names_for(name, layout, family.table), to_hf(entry, meta, layout)):
            shapes[hf_name] = tuple(t.shape)
    return stack_shapes(shapes)


def checkpoint_architecture(shapes: dict, prefix: str) -> dict:
    """Architecture fields readable from a Megatron checkpoint's global tensor shapes.

    Args:
        shapes: ``{key: (global shape, dtype)}`` (``dist_ckpt.tensor_shapes``); prefix: model key prefix.
    """
    def shape(key):
        return shapes.get(prefix + key, (None,))[0]

    emb = shape("embedding.word_embeddings.weight")
    layer_keys = [k[len(prefix):] for k in shapes if k.startswith(prefix + "decoder.layers.")]
    out = {"num_hidden_layers": len({k.split(".")[2] for k in layer_keys}), "hidden_size": emb[1],
           "padded_vocab_size": emb[0], "has_output_layer": shape("output_layer.weight") is not None}
    qkv, q_norm = shape("decoder.layers.0.self_attention.linear_qkv.weight"), shape(
        "decoder.layers.0.self_attention.q_layernorm.weight")
    if qkv and q_norm:
        out.update(q_norm_rows=q_norm[0], qkv_rows=qkv[0],
                   proj_cols=shape("decoder.layers.0.self_attention.linear_proj.weight")[1])
    experts = sorted(k for k in layer_keys if ".mlp.experts." in k and k.endswith("linear_fc2.weight")
                     and len(shapes[prefix + k][0]) == 3)
    if experts:
        out.update(num_experts=shapes[prefix + experts[0]][0][0],
                   moe_intermediate_size=shapes[prefix + experts[0]][0][2])
    return out


def check_checkpoint_matches_config(shapes: dict, prefix: str, hf_config, config_file, ckpt_dir) -> None:
    """Check an HF config against a Megatron checkpoint's tensor shapes before exporting.

    Raises:
        ConfigMismatchError: names the field, the config's value, the checkpoint's value and the file.
    """
    from megarl.models.families import get_family

    arch = get_family(hf_config).architecture(hf_config)
    ckpt = checkpoint_architecture(shapes, prefix)

    def fail(field, config_value, ckpt_value):
        raise ConfigMismatchError(f"{field}: {config_value!r} in {config_file}, but the checkpoint "
                                  f"{ckpt_dir} has {ckpt_value!r}")

    norm = get_family(hf_config).megatron_shapes(arch).get("decoder.layers.0.self_attention.q_layernorm.weight")
    if "q_norm_rows" in ckpt and norm in (None, (arch["head_dim"],)):  # a per-head q norm: head_dim rows
        ckpt["head_dim"] = ckpt["q_norm_rows"]  # (MiniMax-M2's spans every head: qkv_rows / proj_cols check it)
    for field in ("num_hidden_layers", "hidden_size", "head_dim", "num_experts", "moe_intermediate_size"):
        if field in ckpt and arch.get(field, 0) != ckpt[field]:
            fail(field, arch.get(field, 0), ckpt[field])
    if arch.get("num_experts") and "num_experts" not in ckpt:
        fail("num_experts", arch["num_experts"], "no expert weights")
    if ckpt["padded_vocab_size"] < arch["vocab_size"]:
        fail("vocab_size", arch["vocab_size"], f"{ckpt['padded_vocab_size']} embedding rows")
    if ckpt["has_output_layer"] == arch["tie_word_embeddings"]:
        fail("tie_word_embeddings", arch["tie_word_embeddings"],
             "an output layer" if ckpt["has_output_layer"] else "no output layer")
    if "qkv_rows" in ckpt:
        heads, groups, hd = arch["num_attention_heads"], arch["num_key_value_heads"], arch["head_dim"]
        if ckpt["proj_cols"] != heads * hd:
            fail("num_attention_heads", heads, ckpt["proj_cols"] // hd)
        if ckpt["qkv_rows"] != (heads + 2 * groups) * hd:
            fail("num_key_value_heads", groups, (ckpt["qkv_rows"] // hd - heads) // 2)
