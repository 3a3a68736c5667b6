"""GPU only: the real Transformer Engine model's parameters pass the weight-sync plan's checks.

The plan is built from the HF config (canonical names, ``megarl.weight_sync.model_specs``); the
trainer reports its parameters through ``iter_sync_params`` (``Trainer.named_parameters_for_sync``).
Under the TE spec Megatron names the fused norms ``...linear_qkv.layer_norm_weight`` and the
grouped-GEMM experts ``...experts.linear_fc1.weight{E}``; the first sync used to raise in
``weight_sync/validate.check_local_params``.
"""
import pytest
from megarl_gpu_cases import needs_te

from megarl.testing.multiproc import run_ranks

pytestmark = [pytest.mark.gpu, needs_te]  # every test here builds the Transformer Engine layer spec


def _worker(rank, world_size, hf_dir, grouped):
    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.models.families import get_family
    from megarl.models.params import iter_sync_params
    from megarl.training.model import build_model, load_hf_config
    from megarl.training.parallel_state import destroy_parallel, initialize_parallel
    from megarl.weight_sync.layout import EngineLayout, TrainerLayout
    from megarl.weight_sync.manifest_checks import check_local_params
    from megarl.weight_sync.model_specs import param_specs_from_hf_config
    from megarl.weight_sync.plan import build_plan

    ps = initialize_parallel(ParallelConfig(), backend="nccl")
    chunks = build_model(hf_dir, ParallelConfig(), ModelConfig(moe_grouped_gemm=grouped), precision="bf16",
                         device="cuda", spec="te")
    te_names = [n for n, _ in chunks[0].named_parameters()]
    hf_config = load_hf_config(hf_dir)
    layout = get_family(hf_config).layout(hf_config)
    local = dict(iter_sync_params(chunks, ps, layout))
    plan = build_plan(TrainerLayout(), EngineLayout(), param_specs_from_hf_config(hf_config, dtype="bfloat16"))
    check_local_params(plan, 0, local)  # raises WeightSyncError on a name / shape / dtype mismatch
    planned = sorted({t.param.name for b in plan.buckets for t, _ in b.contributions(0)})
    destroy_parallel()
    return te_names, sorted(local), planned


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model,grouped", [("tiny_moe_dir", True), ("tiny_moe_dir", False),
                                           ("tiny_deepseek_v3_dir", True)])
def test_te_model_parameters_pass_the_weight_sync_plan(request, model, grouped):
    hf_dir = request.getfixturevalue(model)
    te_names, local, planned = run_ranks(_worker, 1, args=(str(hf_dir), grouped), backend=None, timeout_s=240)[0]
    assert any(n.endswith("layer_norm_weight") for n in te_names)  # really the TE spec
    if grouped:
        assert any(n.endswith("mlp.experts.linear_fc1.weight0") for n in te_names)
    assert local == planned
