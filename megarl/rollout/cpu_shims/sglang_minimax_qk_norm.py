"""SGLang 0.5.23 MiniMax-M2's q/k norm on a CPU without AMX (CPU server only).

Loaded by ``sitecustomize.py`` of this directory, so only into a CPU SGLang server and the processes it
spawns; the import name is the file name (this directory is on the server's ``PYTHONPATH``).

Why: ``MiniMaxM2QKRMSNorm`` (``sglang/srt/models/minimax_m2.py`` lines 393-505) normalises each
token's whole ``q`` and ``k`` (all of the rank's heads, the sum of squares all-reduced over attention
TP). It picks ``_forward_fused`` on CUDA (line 410), ``_forward_cpu`` with AMX (line 422: the
``sgl_kernel`` CPU build's ``fused_qk_rmsnorm_cpu``), and ``_forward_naive`` everywhere else, which
calls two Triton kernels through ``rms_sumsq_serial`` / ``rms_apply_serial``; both begin with
``assert x1.is_cuda and x2.is_cuda`` (lines 205 and 252). On this CPU (no AMX) the first prefill of a
MiniMax-M2 model fails there.

Fix: once that module has executed, its ``rms_sumsq_serial`` / ``rms_apply_serial`` are wrapped: CPU
tensors are computed by :func:`rms_sumsq` / :func:`rms_apply` in plain torch with the kernels' contract
(written from the Triton kernels ``rmsnorm_sumsq_kernel_serial`` / ``rmsnorm_apply_kernel_serial``,
lines 122-195), CUDA tensors go to SGLang's own functions. SGLang's sources are not edited; nothing is
patched unless the running SGLang is :data:`SUPPORTED_SGLANG` (``sitecustomize`` checks).
"""
from __future__ import annotations

import sys

SUPPORTED_SGLANG = "0.5.23"
TARGET_MODULE = "sglang.srt.models.minimax_m2"


def rms_sumsq(x1, x2):
    """Per-row sums of squares of two row batches, as ``rms_sumsq_serial``.

    Args:
        x1: ``[B, D1]`` (this rank's query heads of each token), x2: ``[B, D2]`` (its key heads).

    Returns:
        ``[P]`` float32, ``P = 4 * ceil(2 B / 4)`` (SGLang pads for its custom all-reduce): ``sum(x1^2)``
        of row ``i`` at ``i``, ``sum(x2^2)`` at ``B + i``, zeros after.
    """
    import torch  # lazily: this module is imported by sitecustomize at every interpreter start

    rows = x1.shape[0]
    out = torch.zeros((2 * rows + 3) // 4 * 4, dtype=torch.float32, device=x1.device)
    out[:rows] = x1.float().pow(2).sum(-1)
    out[rows:2 * rows] = x2.float().pow(2).sum(-1)
    return out


def rms_apply(x1, x2, w1, w2, sum_sq, tp_world: int = 1, eps: float = 1e-5):
    """``x * rsqrt(sum_sq / (D * tp_world) + eps) * w`` in float32, cast back, as ``rms_apply_serial``.

    Args:
        x1, x2: ``[B, D1]``, ``[B, D2]`` as :func:`rms_sumsq`; w1 ``[D1]``, w2 ``[D2]``: this rank's
            slices of the q / k norm weights; sum_sq: :func:`rms_sumsq`'s output, all-reduced over the
            ``tp_world`` attention-TP ranks (so ``D * tp_world`` is the full width).

    Returns:
        ``([B, D1], [B, D2])`` in ``x1`` / ``x2``'s dtypes.
    """
    rows = x1.shape[0]

    def norm(x, w, sums):
        inv_rms = (sums[:, None] / x.shape[1] / tp_world + eps).rsqrt()
        return (x.float() * inv_rms * w.float()).to(x.dtype)

    return norm(x1, w1, sum_sq[:rows]), norm(x2, w2, sum_sq[rows:2 * rows])


def patch_qk_norm(module) -> bool:
    """Wrap ``module.rms_sumsq_serial`` / ``rms_apply_serial`` so that CPU tensors take :func:`rms_sumsq`
    / :func:`rms_apply` (module docstring).

    Returns:
        True if patched; False (with a line on stderr) if either function is missing.
    """
    if not all(hasattr(module, n) for n in ("rms_sumsq_serial", "rms_apply_serial")):
        print(f"[megarl cpu_shims] {TARGET_MODULE} lacks rms_sumsq_serial / rms_apply_serial; MiniMax-M2's "
              "q/k norm NOT given a CPU path", file=sys.stderr)
        return False
    sumsq_cuda, apply_cuda = module.rms_sumsq_serial, module.rms_apply_serial

    def rms_sumsq_serial(x1, x2):
        return sumsq_cuda(x1, x2) if x1.is_cuda else rms_sumsq(x1, x2)

    def rms_apply_serial(x1, x2, w1, w2, sum_sq, tp_world=1, eps=1e-5):
        fn = apply_cuda if x1.is_cuda else rms_apply
        return fn(x1, x2, w1, w2, sum_sq, tp_world, eps)

    module.rms_sumsq_serial, module.rms_apply_serial = rms_sumsq_serial, rms_apply_serial
    return True


PATCHES = {TARGET_MODULE: patch_qk_norm}
