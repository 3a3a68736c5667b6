"""Qwen3.5's gated-DeltaNet and gated-attention CPU kernels for SGLang 0.5.23, in plain torch (CPU server only).

Loaded by ``sitecustomize.py`` of this directory, so only into a CPU SGLang server and the processes it
spawns; the import name is the file name (this directory is on the server's ``PYTHONPATH``).
``sgl_kernel/mamba.py`` of this directory re-exports the three ``sgl_kernel.mamba`` functions.

Why: on ``device == "cpu"`` SGLang 0.5.23 takes Qwen3.5's kernels from the ``sgl_kernel`` CPU build
(compiled from SGLang's repository for AMX Xeons; nothing installable here), at import time:

- ``srt/layers/attention/linear/gdn_backend.py`` lines 183-188: ``from sgl_kernel.mamba import
  causal_conv1d_fn_cpu, causal_conv1d_update_cpu`` and ``torch.ops.sgl_kernel.fused_gdn_gating_cpu``;
- ``srt/layers/attention/linear/kernels/gdn_triton.py`` lines 27-33: ``chunk_gated_delta_rule_cpu``
  (``sgl_kernel.mamba``) and ``torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu``;
- ``srt/models/qwen3_5.py`` lines 283-298: ``torch.ops.sgl_kernel.fused_sigmoid_mul_cpu``,
  ``fused_qk_gemma_rmsnorm_cpu``, ``fused_qk_gemma_rmsnorm_with_gate_cpu``,
  ``fused_qkvzba_split_reshape_cat_contiguous_cpu``.

Without them ``Qwen3_5MoeForCausalLM`` does not import and the server cannot load the model. A third
gap: the DeltaNet's gated RMSNorm (``sglang/kernels/ops/attention/fla/layernorm_gated.py``,
``RMSNorm.forward``) runs a Triton kernel unless the CPU has AMX and the ``sgl_kernel`` build; a fourth:
the gated shared expert of ``Qwen2MoeSparseMoeBlock`` (``srt/models/qwen2_moe.py`` lines 821-825 and
876-881, which Qwen3.5-MoE's layers use) calls the Triton ``fused_gate_sigmoid_mul_add`` unless AMX.

Fix: the ops above as plain-torch functions with SGLang's calling conventions (the formulas are
transformers' ``modeling_qwen3_5_moe.py``: ``causal_conv1d_fn`` / ``causal_conv1d_update``,
``torch_recurrent_gated_delta_rule``, the DeltaNet gates, the zero-centred q/k RMSNorm); the
``torch.ops.sgl_kernel`` ones are set as attributes of that namespace just before each of the three
modules executes (:data:`PRE_PATCHES`), only where the namespace lacks them (a real CPU build wins),
``RMSNorm.forward`` of ``layernorm_gated`` falls back to SGLang's own ``rms_norm_ref`` on a CPU
tensor when SGLang would call Triton, and ``qwen2_moe``'s two shared-expert gate functions compute
``sigmoid(x . w) * shared (+ out)`` in torch for CPU tensors (:data:`PATCHES`). SGLang's sources are
not edited; nothing is installed unless the running SGLang is :data:`SUPPORTED_SGLANG`. Speculative decoding's
tree/verify variants are refused (``NotImplementedError``), as SGLang's CPU server does not run them.

Layouts (SGLang's): conv state pool ``[slots, conv_dim, width - 1]``; recurrent state pool
``[slots, HV, V, K]`` (value-major, transformers keeps ``[K, V]``); tokens packed along one axis with
``query_start_loc`` / ``cu_seqlens`` ``[B + 1]`` and per-request pool slots ``[B]``.
"""
from __future__ import annotations

import sys

SUPPORTED_SGLANG = "0.5.23"
GDN_BACKEND_MODULE = "sglang.srt.layers.attention.linear.gdn_backend"
GDN_KERNEL_MODULE = "sglang.srt.layers.attention.linear.kernels.gdn_triton"
QWEN3_5_MODULE = "sglang.srt.models.qwen3_5"
LAYERNORM_GATED_MODULE = "sglang.kernels.ops.attention.fla.layernorm_gated"
QWEN2_MOE_MODULE = "sglang.srt.models.qwen2_moe"


def _torch():
    import torch

    return torch


# ---- the math (plain torch, float32 inside) ----------------------------------------------------------

def causal_conv(x, weight, bias, silu: bool, state=None):
    """Depthwise causal conv of one sequence: ``out[:, t] = sum_j w[:, j] * xp[:, t + j] (+ bias)``
    with ``xp = [state | x]`` (zeros when ``state`` is None), then SiLU if ``silu``.

    Args:
        x: ``[dim, L]``; weight: ``[dim, W]``; bias: ``[dim]`` or None; state: ``[dim, W - 1]`` or None.

    Returns:
        ``(out [dim, L] in x's dtype, new_state [dim, W - 1])``: the last ``W - 1`` columns of ``xp``.
    """
    torch = _torch()
    width = weight.shape[-1]
    if state is None:
        state = x.new_zeros(x.shape[0], width - 1)
    xp = torch.cat([state.to(x.dtype), x], dim=-1)
    out = torch.nn.functional.conv1d(xp.float().unsqueeze(0), weight.float().unsqueeze(1),
                                     None if bias is None else bias.float(), groups=x.shape[0])[0]
    if silu:
        out = torch.nn.functional.silu(out)
    return out.to(x.dtype), xp[:, xp.shape[-1] - (width - 1):]


def gated_delta_rule(q, k, v, g, beta, state, l2norm: bool = True):
    """The gated delta rule over one sequence, token by token (transformers'
    ``torch_recurrent_gated_delta_rule``): with ``q <- l2norm(q) / sqrt(K)``, ``k <- l2norm(k)``
    (eps 1e-6) and ``S`` the ``[V, K]`` state of a value head,
    ``S <- exp(g_t) S;  S <- S + beta_t (v_t - S k_t) k_t^T;  o_t = S q_t``.
    Value head ``h`` reads key head ``h // (HV / Hk)``.

    Args:
        q, k: ``[L, Hk, K]``; v: ``[L, HV, V]``; g, beta: ``[L, HV]`` (log decay, write strength);
        state: ``[HV, V, K]`` start state (not modified).

    Returns:
        ``(out [L, HV, V] in v's dtype, final state [HV, V, K] float32)``.

    Raises:
        ValueError: ``HV`` not a multiple of ``Hk``.
    """
    torch = _torch()
    heads_v, heads_k = v.shape[1], k.shape[1]
    if heads_v % heads_k:
        raise ValueError(f"gated_delta_rule: value heads {heads_v} not a multiple of key heads {heads_k}")
    q, k = (t.float().repeat_interleave(heads_v // heads_k, dim=1) for t in (q, k))
    if l2norm:
        q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q / (q.shape[-1] ** 0.5)
    s = state.float().clone()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    vf, decay, bf = v.float(), g.float().exp(), beta.float()
    for t in range(v.shape[0]):
        s = s * decay[t][:, None, None]
        delta = (vf[t] - torch.einsum("hvk,hk->hv", s, k[t])) * bf[t][:, None]
        s = s + delta[:, :, None] * k[t][:, None, :]
        out[t] = torch.einsum("hvk,hk->hv", s, q[t])
    return out.to(v.dtype), s


def gdn_gates(A_log, a, b, dt_bias, softplus_beta: float = 1.0, threshold: float = 20.0):
    """``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, float32, as SGLang's
    ``fused_gdn_gating`` (softplus ``log(1 + exp(sb * x)) / sb``, ``x`` itself above ``threshold``).
    ``A_log``, ``dt_bias [HV]``; ``a``, ``b [T, HV]`` -> ``(g [T, HV], beta [T, HV])``."""
    torch = _torch()
    x = a.float() + dt_bias.float()
    soft = torch.where(softplus_beta * x <= threshold, torch.log1p(torch.exp(softplus_beta * x)) / softplus_beta, x)
    return -torch.exp(A_log.float()) * soft, torch.sigmoid(b.float())


def gemma_rms_norm(x, weight, eps: float):
    """Zero-centred RMSNorm over the last dim: ``x / sqrt(mean(x^2) + eps) * (1 + w)`` (float32 inside).
    ``x [..., D]``, ``weight [D]`` -> ``[..., D]`` in ``x``'s dtype."""
    torch = _torch()
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def _segments(cu_seqlens, indices):
    """``(start, end, pool slot)`` per request, skipping padded slots (negative)."""
    bounds, slots = cu_seqlens.tolist(), indices.tolist()
    return [(bounds[i], bounds[i + 1], int(s)) for i, s in enumerate(slots) if int(s) >= 0]


# ---- SGLang's calling conventions ---------------------------------------------------------------------

def causal_conv1d_fn_cpu(x, weight, bias, activation, conv_states, has_initial_state, cache_indices,
                         query_start_loc, seq_lens_cpu=None, **unused):
    """Prefill conv (``GDNAttnBackend._convolve_prefill``): :func:`causal_conv` per request, starting
    from its pool state when ``has_initial_state``, writing the new state back into ``conv_states``.

    Args:
        x: ``[dim, T]`` packed tokens; weight ``[dim, W]``; conv_states ``[slots, dim, W - 1]``;
        has_initial_state ``[B]`` bool; cache_indices ``[B]``; query_start_loc ``[B + 1]``.

    Returns:
        ``[dim, T]``.

    Raises:
        NotImplementedError: a block table (page-major conv state), which SGLang's CPU path never passes.
    """
    if unused.get("block_table") is not None:
        raise NotImplementedError("causal_conv1d_fn_cpu: block_table (page-major conv state) is not supported")
    out = x.new_zeros(x.shape)
    starts = has_initial_state.tolist()
    for i, (s, e, slot) in enumerate(_segments(query_start_loc, cache_indices)):
        init = conv_states[slot] if starts[i] else None
        out[:, s:e], new_state = causal_conv(x[:, s:e], weight, bias, activation in ("silu", "swish"), init)
        conv_states[slot] = new_state.to(conv_states.dtype)
    return out


def causal_conv1d_update_cpu(x, conv_states, weight, bias, activation, conv_state_indices, **spec):
    """Decode conv (one new token per request): ``x [B, dim]`` -> ``[B, dim]``, each request's state in
    ``conv_states[conv_state_indices[i]]`` shifted by its token.

    Raises:
        NotImplementedError: the speculative-verify form (3-D ``x`` or an intermediate conv window).
    """
    if x.dim() != 2 or any(v is not None for v in spec.values()):
        raise NotImplementedError("causal_conv1d_update_cpu: speculative verify is not supported by megarl's CPU shim")
    out = x.new_empty(x.shape)
    for i, slot in enumerate(conv_state_indices.tolist()):
        if slot < 0:
            out[i] = 0
            continue
        res, new_state = causal_conv(x[i][:, None], weight, bias, activation in ("silu", "swish"), conv_states[slot])
        out[i] = res[:, 0]
        conv_states[slot] = new_state.to(conv_states.dtype)
    return out


def chunk_gated_delta_rule_cpu(q, k, v, g, beta, initial_state, cu_seqlens, head_first=False,
                               use_qk_l2norm_in_kernel=True, initial_state_indices=None, **unused):
    """Prefill delta rule (``TritonGDNKernel.extend`` on CPU): :func:`gated_delta_rule` per request from
    its pool state ``initial_state[initial_state_indices[i]]``, which it overwrites with the final state.

    Args:
        q, k: ``[1, T, Hk, K]``; v: ``[1, T, HV, V]``; g, beta: ``[1, T, HV]``;
        initial_state: pool ``[slots, HV, V, K]``; cu_seqlens ``[B + 1]``; initial_state_indices ``[B]``.

    Returns:
        ``(out [1, T, HV, V], final states [B, HV, V, K], None)`` (no per-chunk states).

    Raises:
        NotImplementedError: ``head_first`` layouts or no pool indices.
    """
    torch = _torch()
    if head_first or initial_state_indices is None:
        raise NotImplementedError("chunk_gated_delta_rule_cpu: head_first / unindexed state is not supported")
    out = v.new_zeros(v.shape)
    finals = []
    for s, e, slot in _segments(cu_seqlens, initial_state_indices):
        out[0, s:e], final = gated_delta_rule(q[0, s:e], k[0, s:e], v[0, s:e], g[0, s:e], beta[0, s:e],
                                              initial_state[slot], use_qk_l2norm_in_kernel)
        initial_state[slot] = final.to(initial_state.dtype)
        finals.append(initial_state[slot])
    return out, (torch.stack(finals) if finals else None), None


def fused_gdn_gating_cpu(A_log, a, b, dt_bias):
    """``(g, beta)``, each ``[1, T, HV]`` float32, from ``a, b [T, HV]`` (:func:`gdn_gates`)."""
    g, beta = gdn_gates(A_log, a, b, dt_bias)
    return g.unsqueeze(0), beta.unsqueeze(0)


def fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                               initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel=True,
                                               softplus_beta=1.0, softplus_threshold=20.0, **spec):
    """Decode delta rule (``TritonGDNKernel.decode``): gates (:func:`gdn_gates`) and one step of
    :func:`gated_delta_rule` per request, its pool state updated in place.

    Args:
        q, k: ``[1, B, Hk, K]``; v: ``[1, B, HV, V]``; a, b: ``[B, HV]``; initial_state_source: pool
        ``[slots, HV, V, K]``; initial_state_indices ``[B]``; cu_seqlens ``[B + 1]`` (one token each).

    Returns:
        ``[1, B, HV, V]``.

    Raises:
        NotImplementedError: speculative verify (``disable_state_update``, intermediate buffers) or KDA.
    """
    if spec.get("is_kda") or spec.get("disable_state_update") or spec.get("intermediate_states_buffer") is not None:
        raise NotImplementedError("fused_sigmoid_gating_delta_rule_update_cpu: verify/KDA is not supported")
    g, beta = gdn_gates(A_log, a, b, dt_bias, softplus_beta, softplus_threshold)
    out = v.new_zeros(v.shape)
    for s, e, slot in _segments(cu_seqlens, initial_state_indices):
        out[0, s:e], final = gated_delta_rule(q[0, s:e], k[0, s:e], v[0, s:e], g[s:e], beta[s:e],
                                              initial_state_source[slot], use_qk_l2norm_in_kernel)
        initial_state_source[slot] = final.to(initial_state_source.dtype)
    return out


def fused_sigmoid_mul_cpu(x, gate):
    """In place: ``x *= sigmoid(gate)`` (``gate`` reshaped to ``x``), the gated attention's output gate."""
    torch = _torch()
    x.mul_(torch.sigmoid(gate.float()).to(x.dtype).reshape(x.shape))
    return x


def fused_qk_gemma_rmsnorm_cpu(q, k, q_weight, k_weight, eps, head_dim):
    """``(q rows, k rows)`` ``[rows, head_dim]``, each head normalised by :func:`gemma_rms_norm`."""
    return (gemma_rms_norm(q.reshape(-1, head_dim), q_weight, eps),
            gemma_rms_norm(k.reshape(-1, head_dim), k_weight, eps))


def fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k, q_weight, k_weight, eps, head_dim, num_heads):
    """From ``q_gate [T, H * 2D]`` (per head ``[q_h | gate_h]``) and ``k [T, Hkv * D]``: normalised q
    ``[T * H, D]``, normalised k ``[T * Hkv, D]``, the gate ``[T * H, D]`` (all contiguous)."""
    qg = q_gate.reshape(q_gate.shape[0], num_heads, 2 * head_dim)
    q, gate = qg[..., :head_dim], qg[..., head_dim:]
    q_out, k_out = fused_qk_gemma_rmsnorm_cpu(q.reshape(-1, head_dim), k, q_weight, k_weight, eps, head_dim)
    return q_out.contiguous(), k_out.contiguous(), gate.reshape(-1, head_dim).contiguous()


def fused_qkvzba_split_reshape_cat_contiguous_cpu(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v):
    """Qwen3.5's contiguous projections ``[q | k | v | z]`` and ``[b | a]`` -> ``mixed_qkv [T, 2 Hk K + HV V]``,
    ``z [T, HV, V]``, ``b [T, HV]``, ``a [T, HV]`` (contiguous)."""
    kd, vd = num_heads_qk * head_qk, num_heads_v * head_v
    qkv, z = mixed_qkvz[:, :2 * kd + vd], mixed_qkvz[:, 2 * kd + vd:2 * kd + 2 * vd]
    b, a = mixed_ba[:, :num_heads_v], mixed_ba[:, num_heads_v:2 * num_heads_v]
    return (qkv.contiguous(), z.reshape(-1, num_heads_v, head_v).contiguous(), b.contiguous(), a.contiguous())


TORCH_OPS = {f.__name__: f for f in (
    fused_gdn_gating_cpu, fused_sigmoid_gating_delta_rule_update_cpu, fused_sigmoid_mul_cpu,
    fused_qk_gemma_rmsnorm_cpu, fused_qk_gemma_rmsnorm_with_gate_cpu, fused_qkvzba_split_reshape_cat_contiguous_cpu)}
"""``torch.ops.sgl_kernel`` attribute -> its plain-torch function."""


def install_torch_ops(module=None) -> list[str]:
    """Set each :data:`TORCH_OPS` entry on ``torch.ops.sgl_kernel`` where that namespace lacks it.

    Returns:
        The names set (empty when a real ``sgl_kernel`` CPU build already registered them all).
    """
    namespace = _torch().ops.sgl_kernel
    added = [name for name in TORCH_OPS if not hasattr(namespace, name)]
    for name in added:
        setattr(namespace, name, TORCH_OPS[name])
    return added


def patch_layernorm_gated(module) -> bool:
    """``RMSNorm.forward`` of ``layernorm_gated`` computes SGLang's ``rms_norm_ref`` on a CPU tensor when
    SGLang would run its Triton kernel (no AMX ``sgl_kernel`` build); otherwise SGLang's method runs.

    Returns:
        True if patched; False (with a line on stderr) if the class or ``rms_norm_ref`` is missing.
    """
    cls, ref = getattr(module, "RMSNorm", None), getattr(module, "rms_norm_ref", None)
    if cls is None or ref is None or not hasattr(module, "_use_cpu"):
        print(f"[megarl cpu_shims] {LAYERNORM_GATED_MODULE} lacks RMSNorm/rms_norm_ref/_use_cpu; "
              "gated RMSNorm fallback NOT applied", file=sys.stderr)
        return False
    if getattr(cls.forward, "_megarl_cpu", False):
        return True
    original = cls.forward

    def forward(self, x, z=None):
        if module._use_cpu or x.device.type != "cpu":
            return original(self, x, z)
        if self.activation not in ("swish", "silu"):
            raise NotImplementedError(f"gated RMSNorm on CPU: activation {self.activation!r} (swish/silu only)")
        return ref(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                   norm_before_gate=self.norm_before_gate)

    forward._megarl_cpu = True  # type: ignore[attr-defined]
    cls.forward = forward
    return True


def shared_expert_gate(hidden_states, gate_weight, shared_output, output=None):
    """``sigmoid(hidden_states @ gate_weight)[:, None] * shared_output`` (float32 inside), added into
    ``output`` in place when given (SGLang's ``fused_gate_sigmoid_mul`` / ``_add``: the gated shared
    expert, transformers' ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``).
    ``hidden_states [T, H]``, ``gate_weight [1, H]`` (or ``[H]``), ``shared_output`` and ``output [T, H]``;
    returns ``[T, H]`` in ``shared_output``'s dtype, or None when added into ``output``."""
    torch = _torch()
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float().reshape(-1))[:, None]
    gated = gate * shared_output.float()
    if output is None:
        return gated.to(shared_output.dtype)
    output.copy_((gated + output.float()).to(output.dtype))
    return None


def patch_qwen2_moe(module) -> bool:
    """``fused_gate_sigmoid_mul`` / ``fused_gate_sigmoid_mul_add`` of ``qwen2_moe`` compute
    :func:`shared_expert_gate` on CPU tensors; others reach SGLang's Triton functions.

    Returns:
        True if patched; False (with a line on stderr) if the module lacks them.
    """
    names = ("fused_gate_sigmoid_mul", "fused_gate_sigmoid_mul_add")
    if not all(hasattr(module, n) for n in names):
        print(f"[megarl cpu_shims] {QWEN2_MOE_MODULE} lacks {names}; shared-expert gate fallback NOT applied",
              file=sys.stderr)
        return False
    mul, mul_add = (getattr(module, n) for n in names)

    def fused_gate_sigmoid_mul(hidden_states, gate_weight, shared_output):
        if hidden_states.device.type != "cpu":
            return mul(hidden_states, gate_weight, shared_output)
        return shared_expert_gate(hidden_states, gate_weight, shared_output)

    def fused_gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states):
        if hidden_states.device.type != "cpu":
            return mul_add(hidden_states, gate_weight, shared_output, final_hidden_states)
        return shared_expert_gate(hidden_states, gate_weight, shared_output, final_hidden_states)

    module.fused_gate_sigmoid_mul = fused_gate_sigmoid_mul
    module.fused_gate_sigmoid_mul_add = fused_gate_sigmoid_mul_add
    return True


PRE_PATCHES = {GDN_BACKEND_MODULE: install_torch_ops, GDN_KERNEL_MODULE: install_torch_ops,
               QWEN3_5_MODULE: install_torch_ops}
"""Module name -> patch run right *before* that module executes (it reads the ops at import time)."""

PATCHES = {LAYERNORM_GATED_MODULE: patch_layernorm_gated, QWEN2_MOE_MODULE: patch_qwen2_moe}
"""Module name -> patch run right after that module is imported."""
