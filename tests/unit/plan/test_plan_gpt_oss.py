"""The gpt-oss-120b recipe's model on paper: the planner's parameter count against transformers'
own model (built on the meta device from configs/models/gpt-oss-120b/config.json, the released
config without its MXFP4 quantization_config), and weight sync refused with a one-line reason."""
from pathlib import Path

import pytest
import torch

from megarl.plan.shape import ModelShape

REPO = Path(__file__).resolve().parents[3]
MODEL = REPO / "configs" / "models" / "gpt-oss-120b"


@pytest.mark.slow  # ~8-10 s (transformers' gpt-oss modeling import and the meta model)
@pytest.mark.timeout(120)
def test_total_parameters_match_transformers_model():
    from transformers import AutoConfig, GptOssForCausalLM

    hf = AutoConfig.from_pretrained(MODEL)
    with torch.device("meta"):
        model = GptOssForCausalLM(hf)
    reference = sum(p.numel() for p in model.parameters())
    ours = ModelShape.from_hf_config(hf)
    assert ours.moe_ffn_hidden_size == hf.intermediate_size  # the experts' width (no moe_intermediate_size)
    # the planner pads the vocabulary (201088 -> 201088: already a multiple of 128) and skips biases/sinks
    assert abs(ours.total_params() / reference - 1) < 0.001


@pytest.mark.timeout(60)
def test_weight_sync_is_refused_with_a_reason():
    from transformers import AutoConfig

    from megarl.weight_sync.model_specs import param_specs_from_hf_config
    from megarl.weight_sync.specs import SpecError

    with pytest.raises(SpecError, match="weight sync is not planned yet .*gate_up_proj"):
        param_specs_from_hf_config(AutoConfig.from_pretrained(MODEL), tensor_model_parallel_size=1,
                                   make_vocab_size_divisible_by=128)
