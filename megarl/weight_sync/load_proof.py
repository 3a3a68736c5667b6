"""Engine side: proof that a loaded bucket is in the engine's parameters (runs inside the server).

SGLang 0.5.23's ``load_weights`` answers nothing about what it wrote: a tensor its loader caches
and never uses (DeepSeek's ``q_a_proj`` arriving without ``kv_a_proj_with_mqa``, see
``Family.engine_load_groups``) or a name it skips leaves the old value. After the receiver loads a
checked bucket pre-sharded (``p2p``), :func:`first_unwritten` reads the engine's parameters back:
each received tensor (this rank's slice, bytes checked against the sender's checksum) must appear
bit for bit in a parameter of its own module or its parent (the engine fuses q/k/v into
``qkv_proj``, gate/up into ``gate_up_proj``, ``q_a_proj`` + ``kv_a_proj_with_mqa`` into
``fused_qkv_a_proj_with_mqa``, an expert's matrices into row ranges of ``experts.w13_weight`` /
``w2_weight``), as a block of whole rows (columns may be padded past it), after casting to the
parameter's dtype (the loaders' ``copy_``). A tensor that is nowhere was not written. Where the
weights did not change the old value passes too: the proof counts after a training step.

Cost: one comparison of each received row against the rows of the candidate parameters that
start like it (first row matched over all rows, the rest only at the candidate offsets), per
bucket; an expert's matrix is searched in its own expert's slice first.
"""
from __future__ import annotations

import re
import weakref
from typing import Optional, Sequence

import torch

_PARAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.")
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def first_unwritten(model, named: Sequence[tuple[str, torch.Tensor]]) -> Optional[int]:
    """Index in ``named`` of the first tensor found in none of ``model``'s parameters; None when
    every one is (module docstring).

    Args:
        model: the rank's SGLang model, after ``load_weights`` of ``named``.
        named: ``[(hf_name, tensor), ...]`` this rank loaded (its pre-sharded slices).
    """
    params = _PARAMS.get(model)
    if params is None:
        params = _PARAMS[model] = dict(model.named_parameters())
    for index, (name, tensor) in enumerate(named):
        if not any(_contains(p, tensor) for p in _candidates(params, name)):
            return index
    return None


def _candidates(params: dict, name: str):
    """Parameters that may hold HF tensor ``name``: an expert's slice of its fused expert tensors,
    then the parameters of its module, then of the module's parent."""
    match = _EXPERT.match(name)
    if match:
        expert, prefix = int(match["expert"]), match["prefix"] + "."
        fused = [p for n, p in params.items() if n.startswith(prefix) and p.dim() == 3]
        yield from (p[expert % p.shape[0]] for p in fused)  # EP: contiguous blocks of experts per rank
        yield from (p[e] for p in fused for e in range(p.shape[0]) if e != expert % p.shape[0])
    module = name.rsplit(".", 1)[0]
    parent = module.rsplit(".", 1)[0] if "." in module else ""
    own = [p for n, p in params.items() if n.rsplit(".", 1)[0] == module]
    yield from own
    yield from (p for n, p in params.items() if n.startswith(parent + ".") and not n.startswith(module + "."))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()]) if t.is_floating_point() else t


def _contains(param: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is in ``param`` bit for bit in ``param``'s dtype: a 2-D one as a block of
    whole rows of ``param`` viewed as rows of its last dimension, cut to the tensor's columns; a
    1-D one as a contiguous run of its elements."""
    data = param.detach()
    if tensor.dim() <= 1:
        return 0 < tensor.numel() <= data.numel() and _contains_1d(data.reshape(-1), tensor.reshape(-1).to(data.dtype))
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
    """``want`` as a contiguous run of ``have`` (1-D: norms, biases fused into ``qkv_proj.bias``)."""
    have, want = _bits(have), _bits(want.to(device=have.device))
    n = want.numel()
    for start in (have == want[0]).nonzero().flatten().tolist():
        if start + n <= have.numel() and torch.equal(have[start:start + n], want):
            return True
    return False
