"""Expert stacks: HF tensors holding every expert of a layer, planned per expert, handed over whole.

gpt-oss's checkpoint stacks a layer's experts (``mlp.experts.gate_up_proj [E, H, 2F]``,
``down_proj [E, F, H]`` and their biases) and SGLang 0.5.23 loads such a stack only whole
(``Family.engine_load_groups`` of gpt-oss cites the loader). The plan keeps one HF tensor per
expert, the stack's slice ``name[E]`` (``megarl.models.mapping.expert_slice``), so that every piece
of the machinery (copy instructions, owner senders, engine slices, checksums) works per expert as
for the other families, and keeps each stack's slices in one bucket, back to back in expert order.
Where a bucket meets SGLang's loader (the receiver's load, the ``distributed`` / ``tensor`` /
``shard`` / ``disk`` requests) :func:`stack_expert_slices` makes each complete run of slices the
stacked tensor: a view of the bytes received when the slices lie back to back (they do in a
bucket's buffer and in each engine rank's segment of it), else a copy. Slices of a stack that is
incomplete stay under their ``name[E]``: SGLang skips such a name, and the load proof names it.

The trainer's side: :class:`ShardViews` shows each trainer shard as the family's
``Family.sync_shard_view`` makes it (gpt-oss: experts in HF orientation), computed when read.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from megarl.models.mapping import expert_slice
from megarl.weight_sync.specs import HFTensorSpec


def stack_expert_slices(named: Sequence[tuple[str, torch.Tensor]], num_experts: Callable[[str], int | None],
                        *, views_only: bool = False) -> list[tuple[str, torch.Tensor]]:
    """``named`` with every complete stack's slices replaced by the stacked tensor, at the place of
    its first slice (the other tensors in order).

    Args:
        named: ``[(hf_name, tensor)]``; a slice ``stack[E]`` holds expert E's ``[*S]``.
        num_experts: stack name -> its experts (``E_total``; None: unknown, never stacked).
        views_only: refuse to copy (a flat bucket whose bytes go to SGLang as they lie).

    Returns:
        ``[(hf_name, tensor)]``; a stack whose ``E_total`` slices 0 .. E_total - 1 all appear once,
        with one shape and dtype, becomes ``(stack, [E_total, *S])`` (a view when the slices are
        contiguous and back to back in one storage, else ``torch.stack``).

    Raises:
        ValueError: ``views_only`` and a complete stack's slices are not back to back.
    """
    slices: dict[str, dict[int, torch.Tensor]] = {}
    repeated = set()
    for name, tensor in named:
        base, expert = expert_slice(name)
        if expert is not None:
            got = slices.setdefault(base, {})
            if expert in got:
                repeated.add(base)
            got[expert] = tensor
    complete = {base: _stacked(base, [got[e] for e in range(len(got))], views_only) for base, got in slices.items()
                if base not in repeated and num_experts(base) == len(got) and sorted(got) == list(range(len(got)))
                and len({(tuple(t.shape), t.dtype) for t in got.values()}) == 1}
    out = []
    for name, tensor in named:
        base, expert = expert_slice(name)
        if expert is None or base not in complete:
            out.append((name, tensor))
        elif expert == 0:
            out.append((base, complete[base]))
    return out


def _stacked(base: str, tensors: list[torch.Tensor], views_only: bool) -> torch.Tensor:
    """``[E, *S]`` of ``E`` tensors ``[*S]``: a view of their storage when they lie back to back.

    Raises:
        ValueError: ``views_only`` and they do not.
    """
    first = tensors[0]
    step = first.numel()
    if all(t.is_contiguous() and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
           and t.storage_offset() == first.storage_offset() + i * step for i, t in enumerate(tensors)):
        return first.as_strided((len(tensors), *first.shape), (step, *first.stride()), first.storage_offset())
    if views_only:
        raise ValueError(f"{base}: its expert slices are not back to back in the bucket (the plan keeps them so)")
    return torch.stack(tensors)


def stacked_specs(specs: Sequence[HFTensorSpec]) -> list[HFTensorSpec]:
    """``specs`` as the engine's checkpoint names them: the slices of each stack (in any order and
    number) as one spec ``stack [n, *S]``, ``n`` = the slices present, at the place of its first."""
    counts: dict[str, int] = {}
    for spec in specs:
        base, expert = expert_slice(spec.name)
        if expert is not None:
            counts[base] = counts.get(base, 0) + 1
    out, seen = [], set()
    for spec in specs:
        base, expert = expert_slice(spec.name)
        if expert is None:
            out.append(spec)
        elif base not in seen:
            seen.add(base)
            out.append(HFTensorSpec(base, (counts[base], *spec.shape), spec.dtype, spec.engine_split))
    return out


class ShardViews(Mapping):
    """A trainer rank's shards (global Megatron name -> tensor) as weight sync reads them:
    ``view(name, shard)`` (``Family.sync_shard_view``) computed on each read; the last
    ``cache_size`` results are kept (a shard is read once per piece or part it sends), so at most
    that many copies exist beside the parameters. Iteration and :meth:`values` give the shards
    themselves (their devices and dtypes, which is what is asked of them in a whole)."""

    def __init__(self, shards: Mapping[str, torch.Tensor], view: Callable[[str, torch.Tensor], torch.Tensor],
                 cache_size: int = 8) -> None:
        self._shards, self._view, self._size = shards, view, cache_size
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._cache:
            self._cache.move_to_end(name)
            return self._cache[name]
        shard = self._shards[name]
        detached = shard.detach()
        viewed = self._view(name, detached)
        if viewed is detached:  # not a parameter the family views
            return shard
        self._cache[name] = viewed
        while len(self._cache) > self._size:
            self._cache.popitem(last=False)
        return viewed

    def __contains__(self, name: object) -> bool:
        return name in self._shards  # without computing the view

    def __iter__(self) -> Iterator[str]:
        return iter(self._shards)

    def __len__(self) -> int:
        return len(self._shards)

    def values(self):  # the shards, not their views: see the class docstring
        """The shards themselves (not viewed)."""
        return self._shards.values()


def shard_views(shards: Mapping[str, torch.Tensor], view) -> Mapping[str, torch.Tensor]:
    """``shards`` read through ``view`` (:class:`ShardViews`), or unchanged when ``view`` is None."""
    return shards if view is None else ShardViews(shards, view)


def manifest_entry(manifest: Mapping[str, tuple], name: str) -> tuple | None:
    """``(shape, dtype)`` of HF tensor ``name`` in an engine's checkpoint manifest (name -> ``(shape,
    dtype)``, :func:`megarl.weight_sync.manifest_checks.read_manifest`): a stack's slice ``stack[E]``
    has the stack's shape without its first dimension (E within it); None: unknown."""
    if name in manifest:
        return manifest[name]
    base, expert = expert_slice(name)
    if expert is None or base not in manifest or not 0 <= expert < manifest[base][0][0]:
        return None
    shape, dtype = manifest[base]
    return tuple(shape[1:]), dtype


def manifest_experts(manifest: Mapping[str, tuple] | None) -> Callable[[str], int | None]:
    """Stack name -> its experts (the first dimension of the manifest's tensor; None: not in it), for
    :func:`stack_expert_slices` on the engine side."""
    return lambda base: manifest[base][0][0] if manifest is not None and base in manifest else None
