"""GPU only: the Transformer Engine spec's parameter names (fused layer-norm weights, grouped-GEMM
experts ``weight{E}``) are covered by the mapping table, load from HF and export back unchanged,
and the TE model's forward matches transformers."""
import pytest
import torch

from megarl.testing.multiproc import run_ranks

pytestmark = pytest.mark.gpu


def _worker(rank, world_size, hf_dir, grouped):
    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.conversion.load_hf import load_hf_weights
    from megarl.models.families import get_family
    from megarl.models.mapping import megatron_to_hf
    from megarl.models.params import iter_global_params
    from megarl.training.model import build_model, load_hf_config
    from megarl.training.parallel_state import destroy_parallel, initialize_parallel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ps = initialize_parallel(ParallelConfig(), backend="nccl")
    (model,) = build_model(hf_dir, ParallelConfig(), ModelConfig(moe_grouped_gemm=grouped), precision="fp32",
                           device="cuda", spec="te")
    names = [n for n, _ in model.named_parameters()]
    load_hf_weights([model], hf_dir, ps)
    hf_config = load_hf_config(hf_dir)
    layout = get_family(hf_config).layout(hf_config)
    exported = dict(megatron_to_hf(((i.global_name, p.detach().cpu()) for i, p in
                                    iter_global_params([model], ps, layout)), layout))
    tokens = torch.randint(0, 2000, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    positions = torch.arange(16, device="cuda").unsqueeze(0).expand(2, -1)
    model.eval()
    with torch.no_grad():
        logits = model(tokens, positions, None).float().cpu()
    destroy_parallel()
    return names, exported, logits


@pytest.mark.timeout(300)
@pytest.mark.parametrize("grouped", [True, False])
def test_te_spec_names_roundtrip_and_forward(tiny_moe_dir, grouped):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    names, exported, logits = run_ranks(_worker, 1, args=(str(tiny_moe_dir), grouped), backend=None,
                                        timeout_s=240)[0]
    assert any(n.endswith("self_attention.linear_qkv.layer_norm_weight") for n in names)
    if grouped:
        assert any(n.endswith("mlp.experts.linear_fc1.weight0") for n in names)
    ref = load_file(tiny_moe_dir / "model.safetensors")
    assert sorted(exported) == sorted(ref)
    assert all(torch.equal(exported[k], ref[k]) for k in ref)
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, 2000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits
    assert (logits[..., : expected.shape[-1]] - expected).abs().max().item() <= 2e-3
