"""Engine side: proof that a loaded bucket is in the engine's parameters (runs inside the server).

SGLang 0.5.23's ``load_weights`` answers nothing about what it wrote: a tensor its loader caches
and never uses (DeepSeek's ``q_a_proj`` arriving without ``kv_a_proj_with_mqa``, see
``Family.engine_load_groups``) or a name it skips leaves the old value. After the receiver loads a
checked bucket pre-sharded (``p2p``), :func:`first_unwritten` reads the engine's parameters back:
each received tensor (this rank's slice, bytes checked against the sender's checksum) must appear
bit for bit in a parameter of its own module or its parent (the engine fuses q/k/v into
``qkv_proj``, gate/up into ``gate_up_proj``, ``q_a_proj`` + ``kv_a_proj_with_mqa`` into
``fused_qkv_a_proj_with_mqa``, an expert's matrices into row ranges of ``experts.w13_weight`` /
``w2_weight``; where the engine has no module of the parent's path, the nearest ancestor it has:
SGLang's Qwen3.5 drops ``self_attn``, ``models/qwen3_5.py`` ``load_weights``; expert E's slice of a
gpt-oss stack, ``experts.gate_up_proj[E]``, transposed in expert E of ``w13_weight``), as a block of whole
rows (columns may be padded past it), after casting to the parameter's dtype (the loaders'
``copy_``). A tensor that is nowhere was not written. Where the weights did not change the old value
passes too: the proof counts after a training step.

Parameters SGLang keeps in another domain than the checkpoint's (read in SGLang 0.5.23; the
receiver loads with a custom loader, ``update_weights_from_tensor``'s branch in
``model_executor/model_runner_components/weight_updater.py:373``, which runs no
``process_weights_after_loading``, so a transform made at startup is not redone on an update):

- block-FP8 with the DeepGEMM runner (CUDA): ``Fp8LinearMethod.process_weights_after_loading_block_quant``
  (``layers/quantization/fp8.py:837``) and the MoE method (``grouped_moe=True``) call
  ``requant_block_scale_ue8m0_for_deepgemm`` (``fp8_utils.py:2147``): the weight is re-quantised
  in place and ``weight_scale_inv`` replaced by packed UE8M0 exponents (``transform_scale_ue8m0``,
  int32, another shape), marked ``format_ue8m0`` (``fp8_utils.py:2180``; MXFP8 checkpoints set it
  too, ``fp8.py:792``). The received FP8 weight is copied in as is (found); its fp32 scale is
  nowhere in that parameter: **skipped** (a false alarm otherwise).
- AITER pre-shuffled FP8 (ROCm): ``fp8.py:924-932`` shuffles ``layer.weight`` in place
  (``is_shuffled``, ``aiter_bpreshuffled``): skipped.
- MoE ``triton_kernels`` runner: ``FusedMoE`` stores experts transposed (``layers/moe/
  fused_moe_triton/layer.py:1393-1397``, ``851``): skipped (the module's ``use_triton_kernels``).
- CPU with AMX: ``_amx_process_weight_after_loading`` (``layers/amx_utils.py:127``) packs the
  weights of a module it marks ``use_intel_amx_backend``: skipped (this machine has no AMX).
- Not transforms for the proof: the FlashInfer TRT-LLM MoE shuffle is undone before each load
  (``unquant.py:1114`` ``maybe_restore_..._for_load``, in the weight loader, ``layer.py:1341``) and
  its gate/up swap (``layer.py:1377``) keeps whole rows; padded expert rows / columns
  (``narrow_padded_param_and_loaded_weight``, ``layer.py:838``) leave a block of rows, columns cut.

A tensor not found whose own module holds such a parameter is not counted as unwritten: it is
named in a warning, once per name (:data:`SKIPPED`), and the proof goes on. Every other tensor
must be found. ``weight_sync.load_proof`` (``every_sync``, ``verified_syncs``: the syncs ``verify``
checks, ``off``) says which syncs run it; the stage ticket's ``proof`` tells the receiver.

Cost: one comparison of each received row against the rows of the candidate parameters that
start like it (first row matched over all rows, the rest only at the candidate offsets), per
bucket; an expert's matrix is searched in its own expert's slice first. Measured on CPU (one
thread, 2 shared cores): the tiny Qwen3-MoE twin's 25 parameters as one 1.47 MiB bucket, read back
from transformers' model of it (same names; not SGLang's model): proof 3.8-8.1 ms against 0.2-0.9 ms
for the copies that load it (3 runs), i.e. ~0.15-0.3 ms per tensor, per bucket, per engine rank;
``weight_sync.load_proof: off`` saves that.
"""
from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)

_PARAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> ``(parameters under each module prefix (:func:`_by_ancestor`), {transformed parameter name: why})``."""
PARAM_TRANSFORMS = {"format_ue8m0": "UE8M0 scales (DeepGEMM requant / MXFP8)",
                    "is_shuffled": "AITER pre-shuffled"}
"""Attributes SGLang sets on a parameter whose values it rewrote after loading (module docstring)."""
MODULE_TRANSFORMS = {"use_triton_kernels": "triton_kernels MoE (experts transposed)",
                     "aiter_bpreshuffled": "AITER pre-shuffled",
                     "use_intel_amx_backend": "AMX-packed (CPU)"}
"""Attributes SGLang sets on a module whose own parameters it stores in another layout."""
SKIPPED: set = set()
"""HF names the proof skipped (each logged once per process)."""
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.")
_STACK = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<stack>[a-z_]+)\[(?P<expert>\d+)\]$")
"""Expert E's slice of a stack of every expert (gpt-oss, :mod:`megarl.weight_sync.stacked_experts`)."""
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def first_unwritten(model, named: Sequence[tuple[str, torch.Tensor]]) -> int | None:
    """Index in ``named`` of the first tensor found in none of ``model``'s parameters; None when
    every one is (module docstring).

    Args:
        model: the rank's SGLang model, after ``load_weights`` of ``named``.
        named: ``[(hf_name, tensor), ...]`` this rank loaded (its pre-sharded slices).
    """
    cached = _PARAMS.get(model)
    if cached is None:
        cached = _PARAMS[model] = (_by_ancestor(model), transformed_params(model))
    params, transformed = cached
    for index, (name, tensor) in enumerate(named):
        candidates = _stack_candidates(params, name, tensor) if _STACK.match(name) else (
            (p, tensor) for p in _candidates(params, name))
        if any(_contains(p, t) for p, t in candidates):
            continue
        why = _transformed_owner(transformed, name)
        if why is None:
            return index
        if name not in SKIPPED:
            SKIPPED.add(name)
            log.warning("load proof: %s not checked: %s (its values are not the checkpoint's there)", name, why)
    return None


def transformed_params(model) -> dict[str, str]:
    """``{parameter name: why}`` of ``model``'s parameters SGLang keeps in another domain than the
    checkpoint's (:data:`PARAM_TRANSFORMS`, :data:`MODULE_TRANSFORMS`)."""
    out = {}
    for module_name, module in model.named_modules():
        why = next((w for flag, w in MODULE_TRANSFORMS.items() if getattr(module, flag, False) is True), None)
        for name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            why_param = next((w for flag, w in PARAM_TRANSFORMS.items() if getattr(param, flag, False) is True), why)
            if why_param is not None:
                out[full] = f"{full}: {why_param}"
    return out


def _transformed_owner(transformed: dict, name: str) -> str | None:
    """Why HF tensor ``name`` cannot be found: a transformed parameter of the same kind (its name
    ends like ``name``'s: ``weight`` / ``weight_scale_inv``) under its module's parent (where
    :func:`_candidates` looks: fused modules, an expert's ``experts``), or None."""
    match = _EXPERT.match(name) or _STACK.match(name)
    module = match["prefix"] + ".x" if match else name.rsplit(".", 1)[0]
    parent, kind = module.rsplit(".", 1)[0] + ".", name.rsplit(".", 1)[1]
    if match and "stack" in match.groupdict():  # experts.gate_up_proj[E] -> w13_weight, ..._bias -> w13_weight_bias
        kind = "bias" if match["stack"].endswith("bias") else "weight"
    return next((why for param, why in transformed.items()
                 if param.startswith(parent) and param.rsplit(".", 1)[1].endswith(kind)), None)


def _by_ancestor(model) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """``{module prefix: [(parameter name, parameter), ...]}``: every parameter under each of its
    ancestors (``a``, ``a.b``, ... of ``a.b.c.weight``), built once per model so that finding a
    tensor's candidates costs a lookup, not a scan of every parameter (thousands per engine rank,
    for each of the thousands of tensors a sync loads)."""
    out: dict[str, list] = {}
    for name, param in model.named_parameters():
        parts = name.split(".")
        for depth in range(1, len(parts)):
            out.setdefault(".".join(parts[:depth]), []).append((name, param))
    return out


def _stack_candidates(params: dict, name: str, tensor: torch.Tensor):
    """``(parameter, tensor as it is there)`` for expert E's slice of a stack (:data:`_STACK`): expert
    E of each fused expert parameter of the stack's module (3-D weights, 2-D biases), the slice
    transposed where 2-D (SGLang's gpt-oss loader transposes the ``x @ W`` stack into ``w13_weight
    [E, 2F, H]`` / ``w2_weight [E, H, F]``, ``models/gpt_oss.py:1271``)."""
    match = _STACK.match(name)
    if match is None:  # not a stack's slice: no candidate
        return
    expert = int(match["expert"])
    want = tensor.t() if tensor.dim() == 2 else tensor
    for _, p in params.get(match["prefix"], ()):
        if p.dim() == want.dim() + 1 and expert < p.shape[0]:
            yield p[expert], want


def _candidates(params: dict, name: str):
    """Parameters that may hold HF tensor ``name``: an expert's slice of its fused expert tensors,
    then the parameters of its module, then of the module's parent (``params``:
    :func:`_by_ancestor`)."""
    match = _EXPERT.match(name)
    if match:
        expert = int(match["expert"])
        fused = [p for _, p in params.get(match["prefix"], ()) if p.dim() == 3]
        yield from (p[expert % p.shape[0]] for p in fused)  # EP: contiguous blocks of experts per rank
        yield from (p[e] for p in fused for e in range(p.shape[0]) if e != expert % p.shape[0])
    module = name.rsplit(".", 1)[0]
    yield from (p for n, p in params.get(module, ()) if n.rsplit(".", 1)[0] == module)
    if "." in module:
        parent = module.rsplit(".", 1)[0]
        while parent not in params and "." in parent:  # a module path the engine flattens (SGLang's Qwen3.5
            parent = parent.rsplit(".", 1)[0]  # keeps a layer's attention in the layer: no ``self_attn``)
        yield from (p for n, p in params.get(parent, ()) if not n.startswith(module + "."))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()]) if t.is_floating_point() else t


def _contains(param: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is in ``param`` bit for bit in ``param``'s dtype: a 2-D one as a block of
    whole rows of ``param`` viewed as rows of its last dimension, cut to the tensor's columns; a
    1-D one as a contiguous run of its elements."""
    data = param.detach()
    if tensor.dim() <= 1:
        return 0 < tensor.numel() and 0 < data.numel() and _contains_1d(data.reshape(-1),
                                                                          tensor.reshape(-1).to(data.dtype))
    cols = tensor.shape[-1]
    if data.dim() < 2 or data.shape[-1] < cols:
        return False
    want = _bits(tensor.reshape(-1, cols).to(device=data.device, dtype=data.dtype))
    have = _bits(data.reshape(-1, data.shape[-1])[:, :cols])
    rows = want.shape[0]
    for start in (have == want[0]).all(dim=1).nonzero().flatten().tolist():
        if start + rows <= have.shape[0] and torch.equal(have[start:start + rows], want):
            return True
    return False


def _contains_1d(have: torch.Tensor, want: torch.Tensor) -> bool:
    """``want`` as a contiguous run of ``have`` (1-D: norms, biases fused into ``qkv_proj.bias``), or
    ``have`` as one of ``want`` where ``want`` is longer (a tensor every rank receives whole and SGLang's
    loader cuts itself: gpt-oss's ``sinks``, ``models/gpt_oss.py:1291-1314``)."""
    if want.numel() > have.numel():
        have, want = want.to(have.dtype), have
    have, want = _bits(have), _bits(want.to(device=have.device))
    n = want.numel()
    for start in (have == want[0]).nonzero().flatten().tolist():
        if start + n <= have.numel() and torch.equal(have[start:start + n], want):
            return True
    return False
