"""The Qwen3.5 CPU kernels of ``megarl/rollout/cpu_shims/sglang_gdn_ops.py`` equal transformers'.

Reference: transformers' own torch implementations in ``models/qwen3_5_moe/modeling_qwen3_5_moe.py``
(``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``, ``Qwen3_5MoeRMSNorm``, the DeltaNet gate
formula) run on each whole sequence. The shim ops are called the way SGLang 0.5.23 calls them: two
requests packed along one token axis, states in pools at arbitrary slots, a prefill split in two
(the second part starting from the pool state, as over a radix-cache hit) and then decode steps, so a
state that is dropped, misplaced or read from the wrong slot changes the result. The end-to-end proof
through the real SGLang server is ``tests/integration/rollout/test_engine_qwen3_5_cpu.py``.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from megarl.rollout.cpu_shims import sglang_gdn_ops as ops

pytestmark = pytest.mark.timeout(120)

HK, HV, K, V, W = 2, 4, 8, 6, 4
LENS = (9, 5)
SLOTS = (3, 1)
TOL = 1e-5


@pytest.fixture(scope="module")
def hf():
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    return modeling_qwen3_5_moe


def _seqs(seed: int):
    g = torch.Generator().manual_seed(seed)
    dim = 2 * HK * K + HV * V
    return [dict(x=torch.randn(dim, n, generator=g), q=torch.randn(n, HK, K, generator=g),
                 k=torch.randn(n, HK, K, generator=g), v=torch.randn(n, HV, V, generator=g),
                 a=torch.randn(n, HV, generator=g), b=torch.randn(n, HV, generator=g)) for n in LENS]


def _packed(seqs, key, lo, hi):
    return torch.cat([s[key][..., lo[i]:hi[i]] if key == "x" else s[key][lo[i]:hi[i]] for i, s in enumerate(seqs)],
                     dim=-1 if key == "x" else 0)


def _cu(lo, hi):
    """``query_start_loc`` of the packed requests."""
    return torch.tensor(list(itertools.accumulate((b - a for a, b in zip(lo, hi)), initial=0)), dtype=torch.int32)


def _run_conv(seqs, weight, bias, parts):
    """Shim conv over ``parts`` (list of (lo, hi) per request; hi - lo == 1 for every request = decode)."""
    pool = torch.randn(5, weight.shape[0], W - 1)  # garbage: a fresh request must not read it
    slots = torch.tensor(SLOTS)
    outs = [[] for _ in seqs]
    for step, (lo, hi) in enumerate(parts):
        if step >= 2:  # decode: one token per request
            res = ops.causal_conv1d_update_cpu(_packed(seqs, "x", lo, hi).T.contiguous(), pool, weight, bias, "silu",
                                               slots)
            for i in range(len(seqs)):
                outs[i].append(res[i][:, None])
            continue
        res = ops.causal_conv1d_fn_cpu(_packed(seqs, "x", lo, hi), weight, bias, "silu", pool,
                                       torch.tensor([step > 0] * len(seqs)), slots, _cu(lo, hi), None)
        cu = _cu(lo, hi).tolist()
        for i in range(len(seqs)):
            outs[i].append(res[:, cu[i]:cu[i + 1]])
    return [torch.cat(o, dim=-1) for o in outs]


def _parts():
    """Prefill of the first 4 / 2 tokens, the rest but the last 2 as a second extend, then 2 decodes."""
    first = ([4, 2], [n - 2 for n in LENS])
    return [([0, 0], [4, 2]), first] + [([n - 2 + j for n in LENS], [n - 1 + j for n in LENS]) for j in range(2)]


def test_conv_prefill_extend_and_decode_equal_transformers(hf):
    seqs = _seqs(0)
    weight, bias = torch.randn(seqs[0]["x"].shape[0], W), torch.randn(seqs[0]["x"].shape[0])
    got = _run_conv(seqs, weight, bias, _parts())
    for s, out in zip(seqs, got):
        ref = hf.causal_conv1d_fn(s["x"][None], weight, bias, activation="silu")[0]
        assert (out - ref).abs().max().item() < TOL


def _hf_delta_rule(hf, s, A_log, dt_bias):
    g = -A_log.exp() * torch.nn.functional.softplus(s["a"] + dt_bias)
    q, k = (s[n].repeat_interleave(HV // HK, dim=1)[None] for n in ("q", "k"))
    out, state = hf.torch_chunk_gated_delta_rule(q, k, s["v"][None], g[None], s["b"].sigmoid()[None],
                                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], state[0].transpose(-1, -2)  # [HV, K, V] -> SGLang's [HV, V, K]


def _run_delta_rule(seqs, A_log, dt_bias, pool):
    slots = torch.tensor(SLOTS)
    outs = [[] for _ in seqs]
    for step, (lo, hi) in enumerate(_parts()):
        q, k, v, a, b = (_packed(seqs, n, lo, hi) for n in ("q", "k", "v", "a", "b"))
        if step >= 2:  # decode: SGLang's fused gating + recurrent update
            res = ops.fused_sigmoid_gating_delta_rule_update_cpu(
                A_log=A_log, dt_bias=dt_bias, q=q[None], k=k[None], v=v[None], a=a, b=b, initial_state_source=pool,
                initial_state_indices=slots, cu_seqlens=_cu(lo, hi), use_qk_l2norm_in_kernel=True,
                softplus_beta=1.0, softplus_threshold=20.0)
        else:
            g, beta = ops.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
            res, _, _ = ops.chunk_gated_delta_rule_cpu(q[None], k[None], v[None], g, beta, pool, _cu(lo, hi), False,
                                                       True, slots)
        cu = _cu(lo, hi).tolist()
        for i in range(len(seqs)):
            outs[i].append(res[0, cu[i]:cu[i + 1]])
    return [torch.cat(o) for o in outs]


def test_delta_rule_prefill_extend_and_decode_equal_transformers(hf):
    seqs = _seqs(1)
    A_log, dt_bias = torch.randn(HV) * 0.5, torch.randn(HV)
    pool = torch.zeros(5, HV, V, K)  # SGLang zeroes a request's slot when it is allocated
    got = _run_delta_rule(seqs, A_log, dt_bias, pool)
    for s, out, slot in zip(seqs, got, SLOTS):
        ref, ref_state = _hf_delta_rule(hf, s, A_log, dt_bias)
        assert (out - ref).abs().max().item() < TOL
        assert (pool[slot] - ref_state).abs().max().item() < TOL


def test_the_comparison_sees_the_states(hf):
    # The same comparison fails when the extend ignores the conv state or the delta-rule state.
    seqs = _seqs(2)
    weight = torch.randn(seqs[0]["x"].shape[0], W)
    parts = _parts()[:2]
    cold = [s["x"][:, :n - 2] for s, n in zip(seqs, LENS)]
    got = _run_conv(seqs, weight, None, parts)
    no_state = [torch.cat([hf.causal_conv1d_fn(c[None, :, :lo], weight, None, activation="silu")[0],
                           hf.causal_conv1d_fn(c[None, :, lo:], weight, None, activation="silu")[0]], -1)
                for c, lo in zip(cold, (4, 2))]
    assert max((a - b).abs().max().item() for a, b in zip(got, no_state)) > 1e-3
    A_log, dt_bias = torch.randn(HV) * 0.5, torch.randn(HV)
    warm = _run_delta_rule(seqs, A_log, dt_bias, torch.zeros(5, HV, V, K))
    fresh = [_hf_delta_rule(hf, {n: t[4 if i == 0 else 2:] for n, t in s.items() if n != "x"}, A_log, dt_bias)[0]
             for i, s in enumerate(seqs)]
    assert max((w[4 if i == 0 else 2:] - f).abs().max().item() for i, (w, f) in enumerate(zip(warm, fresh))) > 1e-3


def test_gated_attention_pieces_equal_transformers(hf):
    from transformers import Qwen3_5MoeTextConfig

    torch.manual_seed(3)
    heads, kv_heads, d, t = 4, 2, 16, 5
    norm = hf.Qwen3_5MoeRMSNorm(d, eps=1e-6)
    knorm = hf.Qwen3_5MoeRMSNorm(d, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
        knorm.weight.normal_()
    q_gate, k, attn = torch.randn(t, heads * 2 * d), torch.randn(t, kv_heads * d), torch.randn(t, heads * d)
    q_ref, gate_ref = torch.chunk(q_gate.view(t, heads, 2 * d), 2, dim=-1)  # transformers' Qwen3_5MoeAttention
    q, k_out, gate = ops.fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k, norm.weight, knorm.weight, 1e-6, d, heads)
    assert (q - norm(q_ref).reshape(-1, d)).abs().max().item() < TOL
    assert (k_out - knorm(k.view(t, kv_heads, d)).reshape(-1, d)).abs().max().item() < TOL
    gated = ops.fused_sigmoid_mul_cpu(attn.clone(), gate.view(t, -1))
    assert (gated - attn * torch.sigmoid(gate_ref.reshape(t, -1))).abs().max().item() < TOL
    assert Qwen3_5MoeTextConfig  # the config class this layout belongs to exists in this transformers


def test_split_of_contiguous_projections():
    t, kd, vd = 3, HK * K, HV * V
    qkv, z, b, a = torch.randn(t, 2 * kd + vd), torch.randn(t, vd), torch.randn(t, HV), torch.randn(t, HV)
    out = ops.fused_qkvzba_split_reshape_cat_contiguous_cpu(torch.cat([qkv, z], -1), torch.cat([b, a], -1),
                                                            HK, HV, K, V)
    assert [torch.equal(x, y) for x, y in zip(out, (qkv, z.view(t, HV, V), b, a))] == [True] * 4


def test_install_sets_only_missing_names():
    namespace = torch.ops.sgl_kernel
    try:
        added = ops.install_torch_ops()
        assert set(added) <= set(ops.TORCH_OPS) and all(getattr(namespace, n) is ops.TORCH_OPS[n] for n in ops.TORCH_OPS)
        assert ops.install_torch_ops() == []
        assert not hasattr(namespace, "convert_weight_packed")  # SGLang's AMX probe stays False
    finally:
        for name in ops.TORCH_OPS:
            namespace.__dict__.pop(name, None)


def test_shared_expert_gate_equals_transformers():
    # transformers' Qwen3_5MoeSparseMoeBlock: sigmoid(shared_expert_gate(x)) * shared_expert(x), added to the routed output.
    torch.manual_seed(4)
    x, shared, routed = torch.randn(5, 16), torch.randn(5, 16), torch.randn(5, 16)
    gate = torch.nn.Linear(16, 1, bias=False)
    ref = torch.sigmoid(gate(x)) * shared
    assert (ops.shared_expert_gate(x, gate.weight.detach().squeeze(0), shared) - ref).abs().max().item() < TOL
    out = routed.clone()
    assert ops.shared_expert_gate(x, gate.weight.detach().squeeze(0), shared, out) is None
    assert (out - (routed + ref)).abs().max().item() < TOL
