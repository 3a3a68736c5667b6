"""The gpt-oss-120b recipe's model on paper: the planner's parameter count against transformers'
own model (built on the meta device from configs/models/gpt-oss-120b/config.json, the released
config without its MXFP4 quantization_config), and its weight-sync plan."""
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


@pytest.mark.slow  # ~10-16 s (18,759 parameter specs of the 120B model, its plan twice)
@pytest.mark.timeout(120)
def test_weight_sync_plans_the_recipe_with_each_expert_stack_in_one_bucket():
    """configs/gpt_oss_120b_gpu.yaml's layout (trainer TP2 EP64, engines TP8): every tensor of the
    checkpoint is planned (the 36 x 4 stacks as 128 slices each, an engine load group per stack),
    each stack's slices in one bucket; an engine with expert parallelism is refused by name
    (SGLang's gpt-oss loader has no per-expert path)."""
    from transformers import AutoConfig

    from megarl.weight_sync.engine_slices import PlanError
    from megarl.weight_sync.layout import EngineLayout, TrainerLayout
    from megarl.weight_sync.model_specs import param_specs_from_hf_config
    from megarl.weight_sync.plan import build_plan
    from megarl.weight_sync.stacked_experts import stacked_specs

    specs = param_specs_from_hf_config(AutoConfig.from_pretrained(MODEL), tensor_model_parallel_size=2)
    trainer = TrainerLayout(tensor_model_parallel_size=2, expert_model_parallel_size=64, expert_tensor_parallel_size=1,
                            data_parallel_size=32)
    plan = build_plan(trainer, EngineLayout(tensor_parallel_size=8, num_engines=2), specs, bucket_size_mb=1024)
    stacks = {}
    for bucket in plan.buckets:
        for t in bucket.hf_tensors:
            if t.name.endswith("]"):
                stacks.setdefault(t.name.rsplit("[", 1)[0], set()).add(bucket.index)
    assert len(stacks) == 36 * 4 and all(len(b) == 1 for b in stacks.values())
    stacked = {t.name: t.shape for t in stacked_specs(list(plan.hf_tensors()))}
    assert stacked["model.layers.35.mlp.experts.gate_up_proj"] == (128, 2880, 5760)
    assert stacked["model.layers.0.mlp.experts.down_proj"] == (128, 2880, 2880)
    assert len(stacked) == 3 + 36 * 17  # embed, norm, lm_head; per layer 13 dense tensors and 4 stacks
    ep_plan = build_plan(trainer, EngineLayout(tensor_parallel_size=8, expert_parallel_size=8), specs)
    gate_up = next(t for t in ep_plan.hf_tensors() if t.name.endswith("gate_up_proj[0]"))
    with pytest.raises(PlanError, match="weight_loader_fused"):
        ep_plan.engine_slices_of(gate_up)
