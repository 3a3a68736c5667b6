"""Diagnostic (not a test): MiniMax-M2 layer 0/1 attention and MLP outputs, Megatron on CUDA vs transformers on CPU."""
import json
import tempfile
from pathlib import Path

import torch


def worker(rank, world_size, hf_dir, tokens, inputs):
    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.conversion.load_hf import load_hf_weights
    from megarl.training.model import build_model
    from megarl.training.parallel_state import initialize_parallel

    state = initialize_parallel(ParallelConfig(), backend="nccl")
    chunks = build_model(hf_dir, ParallelConfig(), ModelConfig(hf_path=hf_dir), device="cuda", spec="local")
    load_hf_weights(chunks, hf_dir, state)
    model = chunks[0].eval()
    out = {}
    for i, layer in enumerate(model.decoder.layers):
        for name in ("self_attention", "mlp", "input_layernorm", "pre_mlp_layernorm"):
            mod = getattr(layer, name)
            def hook(m, a, o, key=f"{i}.{name}"):
                o = o[0] if isinstance(o, tuple) else o
                out[key] = o.detach().float().transpose(0, 1).cpu()
            mod.register_forward_hook(hook)
        # isolated: feed HF's exact inputs to attention and mlp
    t = tokens.cuda()
    with torch.no_grad():
        model(t, torch.arange(t.shape[1], device="cuda").expand_as(t), None)
        iso = {}
        for key, x in inputs.items():
            i, name = key.split(".")
            mod = getattr(model.decoder.layers[int(i)], name)
            xs = x.transpose(0, 1).contiguous().cuda()
            if name == "self_attention":
                o = mod(xs, None, rotary_pos_emb=None)
            else:
                o = mod(xs)
            o = o[0] if isinstance(o, tuple) else o
            iso[key] = o.float().transpose(0, 1).cpu()
        router = model.decoder.layers[0].mlp.router
        iso["expert_bias"] = router.expert_bias.float().cpu() if router.expert_bias is not None else None
        fields = ("moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_topk",
                  "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_dtype")
        iso["cfg"] = {k: getattr(router.config, k) for k in fields}
    return out, iso


def main():
    from transformers import AutoModelForCausalLM

    from megarl.models.tiny import TinyModelSpec, make_tiny_model
    from megarl.procs.local_ranks import free_port
    from megarl.testing.multiproc import run_ranks

    hf_dir = make_tiny_model(Path(tempfile.mkdtemp()) / "mm", TinyModelSpec(family="minimax_m2"))
    cfg = json.loads((hf_dir / "config.json").read_text())
    tokens = torch.randint(0, cfg["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(7))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ref, inputs = {}, {}
    def keep(key):
        return lambda m, a, o: ref.__setitem__(key, (o[0] if isinstance(o, tuple) else o).detach())

    for i, layer in enumerate(hf.model.layers):
        layer.self_attn.register_forward_hook(keep(f"{i}.self_attention"))
        layer.mlp.register_forward_hook(keep(f"{i}.mlp"))
        layer.mlp.register_forward_pre_hook(lambda m, a, k=f"{i}.mlp": inputs.__setitem__(k, a[0].detach()))
        layer.input_layernorm.register_forward_hook(keep(f"{i}.input_layernorm"))
        layer.post_attention_layernorm.register_forward_hook(keep(f"{i}.pre_mlp_layernorm"))
    with torch.no_grad():
        hf(tokens)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    (res,) = run_ranks(worker, 1, args=(str(hf_dir), tokens, inputs), backend=None, env=env, timeout_s=200,
                       start_method="spawn")
    out, iso = res
    for k in sorted(ref):
        if k in out:
            print(f"full-run {k}: max diff {(out[k] - ref[k]).abs().max().item():.3g}")
    for k in inputs:
        print(f"isolated {k} (HF's input): max diff {(iso[k] - ref[k]).abs().max().item():.3g}")
    print("expert_bias megatron", iso["expert_bias"])
    print("expert_bias hf", hf.model.layers[0].mlp.e_score_correction_bias)
    print("router cfg", iso["cfg"])


if __name__ == "__main__":
    main()
