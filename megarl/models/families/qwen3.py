"""Qwen3 dense (``Qwen3ForCausalLM``): the Qwen3-MoE attention with a dense SwiGLU MLP."""
from __future__ import annotations

from megarl.models.families import Family
from megarl.models.families import qwen3_moe as moe

TABLE = {**moe.GLOBAL_TABLE, **moe.ATTENTION_TABLE, **moe.DENSE_MLP_TABLE}


def architecture(hf_config) -> dict:
    """Canonical architecture of a dense Qwen3 HF config."""
    arch = moe.common_architecture(hf_config)
    arch["moe_layers"] = [False] * arch["num_hidden_layers"]
    return arch


def tiny_config(spec, common: dict):
    """The ``tiny:qwen3`` config (dense) and model class (:attr:`Family.tiny_config`)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3Config(intermediate_size=spec.intermediate_size, **common), Qwen3ForCausalLM


FAMILY = Family(name="qwen3", twin_engine_tp2=True,  # engine TP 2 at CPU scale (Family.twin_engine_tp2)
                model_types=("qwen3",), table=TABLE, architecture=architecture,
                transformer_config_kwargs=moe.common_transformer_config_kwargs,
                gpt_model_kwargs=moe.gpt_model_kwargs, megatron_shapes=moe.megatron_shapes,
                engine_load_groups=moe.ENGINE_LOAD_GROUPS, reasoning_parser="qwen3", tool_call_parser="qwen25",
                # srt/models/qwen3.py shares embed_tokens when tie_word_embeddings (single PP stage)
                engine_class="sglang.srt.models.qwen3.Qwen3ForCausalLM", engine_unties_lm_head=False,
                tiny_config=tiny_config)
