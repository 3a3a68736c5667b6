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


FAMILY = Family(name="qwen3", model_types=("qwen3",), table=TABLE, architecture=architecture,
                transformer_config_kwargs=moe.common_transformer_config_kwargs,
                gpt_model_kwargs=moe.gpt_model_kwargs, megatron_shapes=moe.megatron_shapes,
                engine_load_groups=moe.ENGINE_LOAD_GROUPS)
