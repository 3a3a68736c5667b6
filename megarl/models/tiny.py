"""Tiny Hugging Face models, made locally, for tests, benchmarks and the CPU demo.

No model hub is reachable on CPU test machines, so tests and the CPU recipe build their policy here:
random weights (seeded) and the GSM8K-trained tokenizer and chat template of
:mod:`megarl.models.tiny_tokenizer`. The directory loads with
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` and is servable by SGLang on CPU.

Weights are written as checkpoint-style safetensors (per-expert names
``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``), which is what real Qwen3-MoE
checkpoints contain and what SGLang's loader accepts.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.models.chat_templates import TEMPLATE_TOKENS
from megarl.models.families import REFERENCE_FAMILY, all_families, find_family, get_family
from megarl.models.tiny_tokenizer import stop_token_ids, tiny_tokenizer


@dataclass(kw_only=True)
class TinyModelSpec:
    """Sizes of a tiny model. Defaults: a 2-layer Qwen3-MoE with 8 experts, top-2."""

    family: str = REFERENCE_FAMILY
    """A family with a ``tiny_config`` (:func:`tiny_families`): ``qwen3_moe`` (Qwen3MoeForCausalLM),
    ``qwen3`` (dense Qwen3ForCausalLM), ``deepseek_v3`` (DeepseekV3ForCausalLM: MLA, YaRN, grouped
    sigmoid router), ``glm4_moe`` (Glm4MoeForCausalLM: GQA with partial rotary, q/k norm, qkv bias,
    sigmoid router), ``gpt_oss`` (GptOssForCausalLM: sinks, sliding/full layers, YaRN, biased
    experts with clamped SwiGLU) or ``kimi_k25`` (Kimi-K2.5's layout: the ``deepseek_v3`` tiny model
    as ``text_config`` under ``language_model.``, a one-block vision tower) or ``qwen3_5_moe``
    (Qwen3_5MoeForCausalLM: gated-DeltaNet and gated-attention layers 3:1, gated shared expert) or
    ``minimax_m2`` (MiniMaxM2ForCausalLM: q/k norms over all heads, partial RoPE, sigmoid router with
    expert bias); each family's module builds its config."""
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    """Dense MLP width (dense family)."""
    moe_intermediate_size: int = 32
    """Per-expert MLP width (MoE family)."""
    num_experts: int = 8
    num_experts_per_tok: int = 2
    first_k_dense_replace: int = 1
    """Leading dense layers before the MoE layers (``deepseek_v3``, ``glm4_moe``)."""
    n_shared_experts: int = 1
    """Shared experts per MoE layer (``deepseek_v3``, ``glm4_moe``)."""
    vocab_size: int = 2048
    """Target BPE vocabulary size including special tokens; config.vocab_size = len(tokenizer)."""
    tie_word_embeddings: bool = False
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 8192
    mtp_layers: int = 0
    """Multi-token-prediction layers appended as the released checkpoints carry them (0 or 1;
    ``deepseek_v3`` and ``glm4_moe``: :func:`append_mtp_layer`)."""
    fp8_block: int = 0
    """Block edge of a block-FP8 checkpoint (DeepSeek-V3's release format, :func:`quantize_checkpoint`:
    ``float8_e4m3fn`` linears with ``_scale_inv`` per ``fp8_block`` x ``fp8_block`` block and a
    ``quantization_config``); 0: unquantised."""
    dtype: str = "float32"
    """``float32`` or ``bfloat16`` weights."""
    seed: int = 0
    chat_template: str = "tiny"
    """``tiny`` (the append-only ``megarl.models.tiny_tokenizer.CHAT_TEMPLATE``) or an official one
    from :mod:`megarl.models.chat_templates` (``qwen3``, ``deepseek_r1``, ``deepseek_v31``,
    ``glm4_moe``), whose special tokens are then added to the tokenizer and whose end-of-turn tokens
    become the EOS ids."""


def _hf_config(spec: TinyModelSpec, vocab_size: int, eos_id: int, pad_id: int):
    common = dict(
        vocab_size=vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, rope_theta=spec.rope_theta,
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None, rms_norm_eps=1e-6)
    family = find_family(spec.family)
    if family is None or family.tiny_config is None:
        raise ValueError(f"family: unknown tiny-model family {spec.family!r} (known: {', '.join(tiny_families())})")
    return family.tiny_config(spec, common)


def tiny_families() -> tuple[str, ...]:
    """The families with a ``tiny:`` model (their :attr:`~megarl.models.families.Family.tiny_config`)."""
    return tuple(f.name for f in all_families() if f.tiny_config is not None)


def _randomize_constant_tensors(model, seed: int) -> None:
    """Replace HF's constant initial values (RMSNorm weights 1, ``e_score_correction_bias`` 0) by
    seeded random ones, as in trained checkpoints, so a conversion that swaps two same-shaped
    norms (q/kv latent norms, q/k norms) or drops the router bias changes the logits. The bias
    is kept in float32, as HF keeps it."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                module.e_score_correction_bias = torch.nn.Buffer(
                    0.05 * torch.randn(bias.shape, generator=gen, dtype=torch.float32))
            if type(module).__name__.endswith("RMSNorm"):
                noise = torch.randn(module.weight.shape, generator=gen)
                module.weight.copy_(1.0 + 0.1 * noise.to(module.weight.dtype))


def _check_checkpoint_options(spec: TinyModelSpec) -> None:
    """Raises ValueError: ``mtp_layers`` other than 0 or 1 (1 only for :data:`MTP_FAMILIES`), or a negative
    ``fp8_block``."""
    if spec.mtp_layers not in (0, 1) or (spec.mtp_layers and spec.family not in MTP_FAMILIES):
        raise ValueError(f"mtp_layers: {spec.mtp_layers} for tiny:{spec.family}; 0, or 1 for {', '.join(MTP_FAMILIES)}")
    if spec.fp8_block < 0:
        raise ValueError(f"fp8_block: {spec.fp8_block}; a block edge > 0, or 0 for unquantised weights")


def _release_layout(hf_dir: Path, spec: TinyModelSpec) -> None:
    """The saved checkpoint as the release carries it: its MTP layer, its block-FP8 weights (``spec``)."""
    if spec.mtp_layers:
        append_mtp_layer(hf_dir, seed=spec.seed)
    if spec.fp8_block:
        quantize_checkpoint(hf_dir, (spec.fp8_block, spec.fp8_block))


def make_tiny_model(out_dir: str | os.PathLike, spec: TinyModelSpec | None = None,
                    gsm8k_dir: str | os.PathLike | None = None, *, overwrite: bool = True) -> Path:
    """Write a tiny random-init HF model directory (config, safetensors, tokenizer, chat template).

    Args:
        out_dir: destination; created (parents too) if missing; written atomically (temp dir + rename).
        spec: sizes and family; defaults to :class:`TinyModelSpec`.
        gsm8k_dir: GSM8K directory for the tokenizer corpus (default: found from the repository).
        overwrite: replace an existing ``out_dir``; if False and another process finished first,
            keep theirs (safe for concurrent callers).

    Returns:
        The output directory.

    Raises:
        ValueError: unknown family, ``mtp_layers`` other than 0 or 1 (1: ``deepseek_v3`` and
            ``glm4_moe`` only), or a negative ``fp8_block``.
        FileNotFoundError: GSM8K not found.
    """
    import shutil
    import uuid

    import torch

    spec = spec or TinyModelSpec()
    _check_checkpoint_options(spec)
    out = Path(out_dir)
    tok = tiny_tokenizer(spec.vocab_size, gsm8k_dir, spec.chat_template)
    eos_id = tok.eos_token_id
    cfg, model_cls = _hf_config(spec, len(tok), eos_id, tok.pad_token_id)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec.dtype]
    torch.manual_seed(spec.seed)
    model = model_cls(cfg).to(dtype)
    if get_family(spec.family).tiny_random_norms:
        _randomize_constant_tensors(model, spec.seed)
    stop_ids = stop_token_ids(tok, spec.chat_template)
    model.generation_config.eos_token_id = stop_ids if len(stop_ids) > 1 else eos_id
    model.generation_config.pad_token_id = tok.pad_token_id
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # with the umask's mode (tempfile.mkdtemp's 0700 would keep teammates out)
    try:
        tok.save_pretrained(tmp)
        # transformers 5 keeps MoE experts fused in memory but saves checkpoint-style per-expert
        # names through its conversion mapping; verified by tests/unit/models/test_tiny_model.py.
        model.save_pretrained(tmp, safe_serialization=True)
        _release_layout(tmp, spec)
        if out.exists() and overwrite:
            shutil.rmtree(out)
        try:
            tmp.rename(out)
        except OSError:
            if overwrite or not (out / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


MTP_FAMILIES = tuple(f.name for f in all_families() if f.tiny_mtp_layer)
"""Tiny families :func:`append_mtp_layer` applies to (``TinyModelSpec.mtp_layers``): those whose
:attr:`~megarl.models.families.Family.tiny_mtp_layer` says their releases carry an MTP layer."""


def append_mtp_layer(hf_dir: str | os.PathLike, *, declare: bool = True, seed: int = 0) -> Path:
    """Add a multi-token-prediction layer to a tiny DeepSeek-V3 / GLM-4.5 directory, in place, as
    the released checkpoints carry one: tensors ``model.layers.{num_hidden_layers}.*`` (a copy of
    the last decoder layer plus ``eh_proj`` (random, from ``seed``), ``enorm``, ``hnorm``) in a second
    safetensors shard with an index, and ``num_nextn_predict_layers = 1`` in config.json when ``declare``.

    Returns:
        The directory.
    """
    import torch
    from safetensors.torch import load_file, save_file

    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    num_layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    if declare:
        cfg["num_nextn_predict_layers"] = 1
        (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    base = load_file(hf_dir / "model.safetensors")
    last, mtp_prefix = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    mtp = {k.replace(last, mtp_prefix): v.clone() for k, v in base.items() if k.startswith(last)}
    gen = torch.Generator().manual_seed(seed + 2)
    mtp.update({mtp_prefix + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen),
                mtp_prefix + "enorm.weight": torch.ones(hidden), mtp_prefix + "hnorm.weight": torch.ones(hidden)})
    shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    (hf_dir / "model.safetensors").rename(hf_dir / shards[0])
    save_file(mtp, hf_dir / shards[1], metadata={"format": "pt"})
    weight_map = {**{k: shards[0] for k in base}, **{k: shards[1] for k in mtp}}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return hf_dir


def quantize_checkpoint(hf_dir: str | os.PathLike, block: tuple[int, int]) -> Path:
    """Turn an unquantised HF directory into a block-FP8 one, in place, as DeepSeek-V3's release is laid
    out: every tensor SGLang 0.5.23 quantises (:meth:`megarl.models.fp8_blocks.BlockFP8.is_quantized`)
    becomes its ``float8_e4m3fn`` :func:`~megarl.models.fp8_blocks.quantize_blockwise` plus a float32
    ``<name>_scale_inv`` in the same file (the index, if any, names it), and ``config.json`` gets
    ``quantization_config`` ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
    "weight_block_size": block}``.

    Returns:
        The directory.
    """
    from safetensors.torch import load_file, save_file

    from megarl.models.fp8_blocks import BlockFP8, quantize_blockwise, scale_name

    hf_dir, rule = Path(hf_dir), BlockFP8(block=block)
    index_path = hf_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    for path in sorted(hf_dir.glob("*.safetensors")):
        out = {}
        for name, tensor in load_file(path).items():
            if rule.is_quantized(name, tensor.shape):
                out[name], out[scale_name(name)] = quantize_blockwise(tensor, block)
                if index is not None:
                    index["weight_map"][scale_name(name)] = path.name
            else:
                out[name] = tensor
        save_file(out, str(path), metadata={"format": "pt"})
    if index is not None:
        index_path.write_text(json.dumps(index))
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return hf_dir


TINY_SCHEME = "tiny:"


def _cache_root() -> Path:
    return Path(os.environ.get("MEGARL_CACHE_DIR", Path.home() / ".cache" / "megarl"))


def parse_tiny_uri(uri: str) -> TinyModelSpec:
    """Parse ``tiny:<family>[?field=value&...]`` into a :class:`TinyModelSpec`.

    Raises:
        ValueError: not a tiny URI, unknown field, or a value of the wrong type (message names it).
    """
    import dataclasses
    from urllib.parse import parse_qsl

    if not uri.startswith(TINY_SCHEME):
        raise ValueError(f"model.hf_path: {uri!r} is not a {TINY_SCHEME}<family> URI")
    family, _, query = uri[len(TINY_SCHEME):].partition("?")
    kwargs: dict = {"family": family or REFERENCE_FAMILY}
    fields = {f.name: f for f in dataclasses.fields(TinyModelSpec)}
    for key, raw in parse_qsl(query, keep_blank_values=True):
        if key not in fields:
            raise ValueError(f"model.hf_path: unknown tiny-model field {key!r} (known: {', '.join(fields)})")
        kinds: dict[str, Callable[[str], Any]] = {"int": int, "float": float,
                                                  "bool": lambda v: v.lower() in ("1", "true", "yes")}
        kind = kinds.get(str(fields[key].type), str)
        try:
            kwargs[key] = kind(raw)
        except ValueError as e:
            raise ValueError(f"model.hf_path: tiny-model field {key}={raw!r}: {e}") from e
    if kwargs["family"] not in tiny_families():
        raise ValueError(f"model.hf_path: unknown tiny-model family {kwargs['family']!r} "
                         f"(known: {', '.join(tiny_families())})")

    if kwargs.get("chat_template", "tiny") not in ("tiny", *TEMPLATE_TOKENS):
        raise ValueError(f"model.hf_path: unknown tiny-model chat_template {kwargs['chat_template']!r} "
                         f"(known: tiny, {', '.join(TEMPLATE_TOKENS)})")
    return TinyModelSpec(**kwargs)


def resolve_model_path(hf_path: str) -> str:
    """Turn ``tiny:<family>[?...]`` into a directory (built once, cached); other paths pass through.

    The cache lives under ``$MEGARL_CACHE_DIR`` (default ``~/.cache/megarl``), keyed by the spec,
    so every process of a run (and every run) resolves the same URI to the same weights.
    """
    import dataclasses
    import hashlib

    if not hf_path.startswith(TINY_SCHEME):
        return hf_path
    spec = parse_tiny_uri(hf_path)
    fields = dataclasses.asdict(spec)
    for name, default in (("chat_template", "tiny"), ("mtp_layers", 0), ("fp8_block", 0)):
        if fields[name] == default:  # keys of models built before the field existed stay valid
            del fields[name]
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    out = _cache_root() / "tiny" / f"{spec.family}-{key}"
    if not (out / "config.json").is_file():
        make_tiny_model(out, spec, overwrite=False)
    return str(out)
