"""DeepSeek-V3 and GLM-4.5 on Megatron-Core (CPU, gloo) against transformers and SGLang.

References: transformers' forward pass of the same HF directory (logits, and the experts its
router picks), HF's router weight formula written in the test for forced routes, the original
safetensors files, and SGLang's own ``load_weights`` / server.

- Forward: Megatron (TP1, EP2: 2 ranks, alltoall dispatch) vs transformers, max |logit diff| <= 1e-4
  (fp32); Megatron's routers choose the same experts as HF's.
- Routing replay: replaying the recorded routes reproduces the logits bit for bit; replaying other
  routes gives HF's output for those routes, and the router weight still gets a gradient while
  the expert bias (frozen, HF ``e_score_correction_bias``) gets none.
- Conversion: HF -> Megatron dist checkpoint (TP1 / EP2 / PP2) -> HF is bit-identical (gpt-oss
  too: its stacked experts); DeepSeek's multi-token-prediction layer is dropped on import.
- SGLang (CPU): both families are served from the exported directory (prompt logprobs and greedy
  tokens vs transformers; DeepSeek-V3's MLA prefill runs through megarl's CPU shim
  ``rollout/cpu_shims/sglang_mla_dispatch.py``), and every exported HF name is checked against the
  served model's own ``load_weights`` (``test_families_v3_glm_probe.py``).
"""
import asyncio
import functools
import json
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megarl.conversion.convert import hf_to_megatron, megatron_to_hf_dir
from megarl.testing.checkpoints import load_safetensors_dir as _load_all

FAMILIES = ("deepseek_v3", "glm4_moe")
LAYOUTS = {"tp1": {}, "ep2": {"expert_model_parallel_size": 2}, "pp2": {"pipeline_model_parallel_size": 2}}
BATCH, SEQ = 2, 16
_EXPORTS: dict = {}


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("families_v3_glm")


def _model_dir(request, family) -> Path:
    return request.getfixturevalue(f"tiny_{family}_dir")


def _export(hf_dir: Path, work: Path, layout: str) -> Path:
    """HF -> Megatron dist checkpoint at ``layout`` -> HF, once per module."""
    key = (str(hf_dir), layout)
    if key not in _EXPORTS:
        ckpt = hf_to_megatron(hf_dir, work / f"ckpt_{hf_dir.name}_{layout}", timeout_s=240, **LAYOUTS[layout])
        _EXPORTS[key] = megatron_to_hf_dir(ckpt, work / f"hf_{hf_dir.name}_{layout}", timeout_s=240)
    return _EXPORTS[key]


# ------------------------------------------------------------------------------------ forward
def _forward_worker(rank, world_size, hf_dir, tokens, forced_routes):
    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.conversion.load_hf import load_hf_weights
    from megarl.training.model import build_model
    from megarl.training.parallel_state import initialize_parallel
    from megarl.training.routing_replay import RoutingReplay

    parallel = ParallelConfig(expert_model_parallel_size=world_size)
    state = initialize_parallel(parallel, backend="gloo")
    chunks = build_model(hf_dir, parallel, ModelConfig(hf_path=hf_dir), device="cpu", spec="local")
    load_hf_weights(chunks, hf_dir, state)
    model = chunks[0]
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    replay = RoutingReplay(chunks)
    with torch.no_grad():
        free = model(tokens, position_ids, None)
        replay.record()
        model(tokens, position_ids, None)
        recorded = replay.take_recorded()  # {layer: [S*B, K]} in Megatron's token order (s, b)
        routes = torch.full((forced_routes.shape[0], len(model.decoder.layers), forced_routes.shape[2]), -1)
        for layer, ids in recorded.items():
            routes[:, layer] = ids
        replay.replay(routes)
        replayed = model(tokens, position_ids, None)
    replay.replay(forced_routes)
    forced = model(tokens, position_ids, None)
    forced.sum().backward()
    router = model.decoder.layers[1].mlp.router
    return dict(free=free, replayed=replayed, forced=forced.detach(), recorded=recorded,
                router_grad_norm=float(router.weight.grad.norm()), bias_requires_grad=router.expert_bias.requires_grad,
                bias_grad=router.expert_bias.grad, bias=router.expert_bias.detach().clone())


def _forced_gate(gate, indices, hidden_states):
    """HF's sigmoid router (DeepseekV3TopkRouter / Glm4MoeTopkRouter) with the expert choice given:
    weights = sigmoid(h W^T) at the chosen experts, renormalised, times routed_scaling_factor."""
    logits = F.linear(hidden_states.view(-1, gate.hidden_dim).float(), gate.weight.float())
    weights = logits.sigmoid().gather(1, indices)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * gate.routed_scaling_factor
    return logits, weights, indices


def _hf_forward(hf_dir, tokens, forced=None):
    """transformers logits ``[B, S, V]`` and the experts each MoE layer chose ``{layer: [B*S, K]}``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    routes = {}
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None:
            continue
        if forced is not None:
            gate.forward = functools.partial(_forced_gate, gate, forced[i])
        gate.register_forward_hook(lambda module, args, out, i=i: routes.__setitem__(i, out[2]))
    with torch.no_grad():
        return model(tokens).logits, routes


def _to_megatron_order(ids):
    """``[B*S, K]`` (HF, b-major) -> ``[S*B, K]`` (Megatron, s-major)."""
    return ids.view(BATCH, SEQ, -1).transpose(0, 1).reshape(BATCH * SEQ, -1)


def _to_hf_order(ids):
    return ids.view(SEQ, BATCH, -1).transpose(0, 1).reshape(BATCH * SEQ, -1)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_and_routing_replay_match_transformers(family, request):
    from megarl.testing.multiproc import run_ranks

    hf_dir = _model_dir(request, family)
    config = json.loads((hf_dir / "config.json").read_text())
    tokens = torch.randint(0, config["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    ref_logits, ref_routes = _hf_forward(hf_dir, tokens)
    moe_layer = config["first_k_dense_replace"]
    assert list(ref_routes) == [moe_layer]
    # Forced routes: every token's HF choice shifted by one expert (still K distinct experts).
    shifted = (ref_routes[moe_layer] + 1) % config["n_routed_experts"]
    forced = torch.full((SEQ * BATCH, config["num_hidden_layers"], shifted.shape[1]), -1, dtype=torch.int64)
    forced[:, moe_layer] = _to_megatron_order(shifted)
    ranks = run_ranks(_forward_worker, 2, args=(str(hf_dir), tokens, forced), timeout_s=360)

    vocab = config["vocab_size"]
    out = ranks[0]
    for other in ranks[1:]:  # EP2: both ranks ran the same batch
        assert torch.equal(other["free"], out["free"]) and torch.equal(other["forced"], out["forced"])
    diff = (out["free"][..., :vocab] - ref_logits).abs().max().item()
    assert diff <= 1e-4, f"{family}: max |Megatron - transformers| logit diff {diff:.3g}"
    got = _to_hf_order(out["recorded"][moe_layer]).sort(dim=-1).values
    assert torch.equal(got, ref_routes[moe_layer].sort(dim=-1).values)
    assert torch.equal(out["replayed"], out["free"])

    forced_ref, _ = _hf_forward(hf_dir, tokens, forced={moe_layer: shifted})
    forced_diff = (out["forced"][..., :vocab] - forced_ref).abs().max().item()
    assert forced_diff <= 1e-4, f"{family}: forced-route logit diff {forced_diff:.3g}"
    assert (out["forced"] - out["free"]).abs().max().item() > 1e-3  # the replayed routes mattered
    assert out["router_grad_norm"] > 0 and out["bias_grad"] is None and not out["bias_requires_grad"]
    from safetensors import safe_open
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        assert torch.equal(out["bias"], f.get_tensor(f"model.layers.{moe_layer}.mlp.gate.e_score_correction_bias"))


# ------------------------------------------------------------------------------------ conversion
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES + ("gpt_oss",))  # gpt-oss: TP2 layouts in test_family_gpt_oss.py
def test_roundtrip_bit_identical(family, layout, request, work_dir):
    hf_dir = _model_dir(request, family)
    exported = _export(hf_dir, work_dir, layout)
    ref, out = _load_all(hf_dir), _load_all(exported)
    assert sorted(out) == sorted(ref)
    for name, tensor in ref.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name
    assert json.loads((exported / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())


@pytest.mark.timeout(400)
def test_bf16_roundtrip_keeps_fp32_router_bias(work_dir):
    """Released DeepSeek-V3 / GLM-4.5 checkpoints are bf16 with an fp32 e_score_correction_bias."""
    from megarl.models.tiny import TinyModelSpec, make_tiny_model

    hf_dir = make_tiny_model(work_dir / "deepseek_bf16", TinyModelSpec(family="deepseek_v3", dtype="bfloat16"))
    ref = _load_all(hf_dir)
    assert ref["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert ref["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    out = _load_all(_export(hf_dir, work_dir, "ep2"))
    assert sorted(out) == sorted(ref)
    for name, tensor in ref.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name


@pytest.mark.timeout(400)
def test_deepseek_mtp_layer_dropped_on_import(tiny_deepseek_v3_dir, work_dir, caplog):
    import shutil

    from megarl.models.tiny import append_mtp_layer

    with_mtp = append_mtp_layer(shutil.copytree(tiny_deepseek_v3_dir, work_dir / "deepseek_mtp"))
    with caplog.at_level(logging.WARNING, logger="megarl.models.families.deepseek_v3"):
        ckpt = hf_to_megatron(with_mtp, work_dir / "ckpt_mtp", timeout_s=240)
    assert "multi-token-prediction layer(s) (HF model.layers.2..2) are dropped" in caplog.text
    out = _load_all(megatron_to_hf_dir(ckpt, work_dir / "hf_mtp", timeout_s=240))
    ref = _load_all(tiny_deepseek_v3_dir)
    assert sorted(out) == sorted(ref) and all(torch.equal(out[k], ref[k]) for k in ref)


# ------------------------------------------------------------------------------------ SGLang
PROBE = "test_families_v3_glm_probe.check_sglang_names"


def _engine(model_dir: Path, log_dir: Path, name: str):
    from megarl.rollout import cpu_shims
    from megarl.rollout.engine_process import EngineProcess

    pythonpath = cpu_shims.apply_to_env(dict(os.environ))["PYTHONPATH"] + os.pathsep + str(Path(__file__).parent)
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath, "MEGARL_NAME_PROBE_OUT": str(log_dir / f"{name}.json")}
    return EngineProcess(model_dir, device="cpu", dtype="float32", mem_fraction_static=0.05, max_total_tokens=4096,
                         grammar_backend="none", custom_weight_loaders=[PROBE], env=env,
                         log_path=log_dir / f"{name}.log", engine_id=name)


@pytest.fixture(scope="module")
def sglang_engines(request, work_dir):
    """One SGLang CPU server per family on its exported (HF -> Megatron EP2 -> HF) directory. They
    start one after the other: a server binds more ports than its HTTP one, and a second server
    starting meanwhile may pick one of them."""
    engines = {}
    try:
        for family in FAMILIES:
            exported = _export(_model_dir(request, family), work_dir, "ep2")
            engines[family] = _engine(exported, work_dir, f"sglang_{family}").start()
            engines[family].wait_healthy(300)
        yield engines
    finally:
        for engine in engines.values():
            engine.stop(grace_s=0)


async def _probe_names(engine, named_tensors):
    from megarl.rollout.client import SGLangClient

    async with SGLangClient(engine.url, request_timeout_s=300) as client:
        await client.begin_weight_update()
        await client.update_weights_from_tensor([named_tensors], load_format=PROBE, flush_cache=False)
        await client.end_weight_update()


async def _prompt_logprobs_and_greedy(engine, input_ids, num_new_tokens):
    from megarl.rollout.client import SGLangClient

    async with SGLangClient(engine.url, request_timeout_s=300) as client:
        logprobs = await client.prompt_logprobs(input_ids)
        out = await client._post("/generate", {"input_ids": list(input_ids), "sampling_params": {
            "max_new_tokens": num_new_tokens, "temperature": 0.0, "ignore_eos": True}})
    return logprobs, out["output_ids"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", FAMILIES)
def test_sglang_loads_every_exported_name(family, sglang_engines, work_dir):
    engine = sglang_engines[family]
    named = sorted(_load_all(engine.model_path).items())
    asyncio.run(_probe_names(engine, named))
    report = json.loads((work_dir / f"sglang_{family}.json").read_text())
    assert report["unfilled_with_all"] == [], "engine parameters no exported tensor writes"
    assert report["ignored"] == [], "exported tensors the engine's load_weights silently ignores"
    assert len(report["engine_params"]) > 10


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", FAMILIES)
def test_sglang_serves_exported_family(family, sglang_engines):
    from transformers import AutoModelForCausalLM

    engine = sglang_engines[family]
    input_ids = torch.randint(0, 2000, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    logprobs, generated = asyncio.run(_prompt_logprobs_and_greedy(engine, input_ids, 4))
    model = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([input_ids])).logits[0], dim=-1)
        greedy = model.generate(torch.tensor([input_ids]), max_new_tokens=4, do_sample=False)[0, len(input_ids):]
    ref_logprobs = ref[:-1].gather(1, torch.tensor(input_ids[1:])[:, None])[:, 0]
    diff = (torch.tensor(logprobs) - ref_logprobs).abs().max().item()
    assert diff < 2e-3, f"SGLang vs transformers prompt logprob diff {diff:.3g}"
    assert generated == greedy.tolist()
