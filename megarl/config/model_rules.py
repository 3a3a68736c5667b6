"""The rules that read the model's ``config.json``: family, parsers, and the layers, heads and
experts over the trainer's and the engines' parallel layout."""
from __future__ import annotations

from pathlib import Path

from megarl.config.builds import build_hint
from megarl.config.checker import Checker
from megarl.config.parallel import model_split_issues


def read_hf_config(hf_path: str):
    """Read ``{hf_path}/config.json`` through ``transformers.AutoConfig`` (both 4.x and 5 spellings).

    Raises:
        OSError / ValueError: unreadable or unknown config.
    """
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(hf_path, trust_remote_code=False, local_files_only=True)


def num_experts_of(hf_config) -> int:
    """Routed experts per MoE layer (0 for dense models), whichever spelling the config uses (read
    from the language model's config where a vision-language config nests it)."""
    from megarl.models.families import text_config_of

    hf_config = text_config_of(hf_config)
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    return 0


def _family_error(hf_config) -> str | None:
    """Why the model family registry (megarl.models.families) cannot handle this config, or None."""
    from megarl.models.families import get_family

    try:
        get_family(hf_config)
    except ValueError as e:
        return str(e)
    return None


def read_model_config(c: Checker):
    """``model.hf_path``'s ``config.json``, or None after reporting why it cannot be read."""
    hf_path = c.cfg.model.hf_path
    if not c.check(Path(hf_path).is_dir() and (Path(hf_path) / "config.json").is_file(), "model.hf_path",
                   "must be a Hugging Face model directory containing config.json (or a hub id "
                   "org/name[@revision], which the megarl commands resolve first: megarl.config.hub)"
                   + build_hint(hf_path)):
        return None
    try:
        return read_hf_config(hf_path)
    except Exception as e:  # noqa: BLE001 - any failure to parse is reported with the key
        c.check(False, "model.hf_path", f"config.json could not be read: {e}")
        return None


def check_model(c: Checker) -> None:
    """``config.json`` against the family registry, SGLang, the parsers and both parallel layouts."""
    hf = read_model_config(c)
    if hf is None:
        return
    family_error = _family_error(hf)
    c.check(family_error is None, "model.hf_path", f"config.json: {family_error}")
    model_type = getattr(hf, "model_type", None)
    # Tied checkpoints need no rule: where SGLang keeps lm_head apart (Qwen3-MoE, GLM-4.5) the engines
    # serve an untied view and every sync sends the embedding as lm_head.weight (megarl.rollout.engine_view).
    from megarl.rollout.reasoning import parser_issues

    agent = c.cfg.rollout.agent
    for key, message in parser_issues(model_type, agent.reasoning_parser, agent.tool_call_parser):
        c.check(False, key, message)
    from megarl.models.families import text_config_of

    text = text_config_of(hf)  # sizes: the language model's (Kimi-K2.5 nests them under text_config)
    _check_trainer_split(c, text)
    _check_engine_split(c, text)


def _check_trainer_split(c: Checker, hf) -> None:
    """Heads, layers and experts over the trainer's TP / PP / EP (:mod:`megarl.config.parallel`)."""
    p = c.cfg.parallel
    tp = p.tensor_model_parallel_size
    heads, groups = hf.num_attention_heads, getattr(hf, "num_key_value_heads", hf.num_attention_heads)
    c.check(heads % tp == 0, "parallel.tensor_model_parallel_size",
            f"num_attention_heads={heads} (config.json) must be divisible by TP")
    c.check(groups % tp == 0, "parallel.tensor_model_parallel_size",
            f"num_key_value_heads (query groups)={groups} (config.json) must be divisible by TP")
    experts = num_experts_of(hf)
    for key, message in model_split_issues(p, num_layers=hf.num_hidden_layers, num_experts=experts):
        c.check(False, key, message)
    if experts:
        _check_moe_fp8(c)
    else:
        c.check(c.cfg.train.routing_replay == "none", "train.routing_replay", "routing replay needs an MoE model")


def _check_engine_split(c: Checker, hf) -> None:
    """Experts and heads over the engines' EP / TP."""
    engine = c.cfg.rollout.engine
    experts, engine_ep = num_experts_of(hf), engine.expert_parallel_size
    if experts:
        c.check(engine_ep < 1 or experts % engine_ep == 0, "rollout.engine.expert_parallel_size",
                f"num_moe_experts={experts} (config.json) must be divisible by the engine EP")
    else:
        c.check(engine_ep == 1, "rollout.engine.expert_parallel_size", "the model has no experts: use 1")
    heads, etp = hf.num_attention_heads, engine.tensor_parallel_size
    c.check(heads % etp == 0, "rollout.engine.tensor_parallel_size",
            f"num_attention_heads={heads} (config.json) must be divisible by the engine TP")


def _check_moe_fp8(c: Checker) -> None:
    """FP8 on an MoE model pads each expert's routing map (megarl.training.fp8: moe_router_padding_for_fp8),
    which Megatron-Core 0.16.1 refuses with the allgather dispatcher (TransformerConfig.__post_init__)."""
    fp8 = c.cfg.train.fp8
    c.check(fp8 is None or c.cfg.model.moe_token_dispatcher_type != "allgather", "model.moe_token_dispatcher_type",
            f"train.fp8={fp8} pads the routing map per expert (moe_router_padding_for_fp8), which Megatron-Core "
            "refuses with the allgather dispatcher: set model.moe_token_dispatcher_type=alltoall or train.fp8=null")
