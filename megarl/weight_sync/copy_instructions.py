"""Where every row (or column) of every HF tensor comes from: the conversion as copy instructions.

The sender of a stage writes each bucket's HF tensors straight into the flat buffer that goes to
the engines, and receives other ranks' shards straight into it where possible, instead of first
assembling full Megatron tensors and converting them. The instructions are derived from the model
family's own mapping (``megarl.conversion``: ``split_tp`` and ``to_hf``) by running it on index
tensors: for a parameter split along rows (``TPSplit.COLUMN`` / ``GLU`` / ``NONE``), tracing
``arange(rows)`` through ``split_tp`` and ``to_hf`` tells, for each HF row, which shard and which
row of that shard holds it; runs of consecutive rows become one :class:`Piece`. A parameter split
along columns (``TPSplit.ROW``; always a plain copy) becomes one column block per shard.

A row piece is contiguous in the shard and in the HF tensor, so a remote shard's rows can be
received directly into the flat buffer (no copy); a column piece is strided in the HF tensor and is
received whole into a temporary, then copied.

A sectioned HF tensor (``EngineSplit.SECTION_ROWS``, the gated DeltaNet's ``[q; k; v]``) is held by
an engine rank as one row block per section (:class:`~megarl.weight_sync.engine_slices.TensorSlice`);
with ``engine_tp_size`` T its pieces are also cut at those blocks' edges (``s_start + r * n_s / T``),
so that every piece lies in one block of one engine rank's slice.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megarl.weight_sync.manifest_checks import WeightSyncError
from megarl.weight_sync.plan import ParamTransfer
from megarl.weight_sync.stacked_experts import shard_views


@dataclass(frozen=True)
class Piece:
    """Rows (``axis`` 0) or columns (``axis`` 1) ``src`` of shard ``shard`` -> ``dst`` of HF tensor ``hf_index``."""

    hf_index: int
    shard: int
    axis: int
    src: tuple[int, int]
    dst: tuple[int, int]


def _runs(shard: torch.Tensor, src: torch.Tensor, cuts: tuple[int, ...] = ()) -> list[tuple[int, int, int, int]]:
    """Per HF row its ``shard`` and ``src`` row -> runs ``(shard, src_start, dst_start, length)``; a run
    also ends before every HF row in ``cuts``."""
    n = shard.numel()
    if n == 0:
        return []
    breaks = torch.ones(n, dtype=torch.bool)
    breaks[1:] = (shard[1:] != shard[:-1]) | (src[1:] != src[:-1] + 1)
    breaks[[c for c in cuts if 0 < c < n]] = True
    starts = torch.nonzero(breaks)[:, 0].tolist() + [n]
    return [(int(shard[a]), int(src[a]), a, b - a) for a, b in zip(starts[:-1], starts[1:])]


class Placement:
    """Copy instructions for a model family's parameters (see module docstring).

    Args:
        model_layout: ``Family.layout(hf_config, tp_size=...)`` of the trained model.
        table: the mapping table the plan's specs were named from (default: the family's;
            ``model_specs.engine_table`` for a tied model whose engine keeps its own ``lm_head``,
            or a family's ``Family.sync_table``).
        shard_view: ``Family.sync_shard_view`` where ``table`` is the family's ``sync_table``: the
            trainer shards are read through it (:meth:`local_view`); None: as they are.
        engine_tp_size: the engines' TP: sectioned HF tensors' pieces are cut at its ranks' section
            blocks (module docstring); 1 = no cuts beyond the shards'.
    """

    def __init__(self, model_layout, table=None, shard_view=None, *, engine_tp_size: int = 1) -> None:
        from megarl.models.mapping import family_table

        self.layout = model_layout
        self.table = table if table is not None else family_table(model_layout)
        self.shard_view = shard_view
        self.engine_tp_size = engine_tp_size
        self._pieces: dict[tuple, tuple[Piece, ...]] = {}

    def local_view(self, shards: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """A rank's shards (global name -> tensor) as the pieces read them (``shard_view``,
        :class:`megarl.weight_sync.stacked_experts.ShardViews`)."""
        return shard_views(shards, self.shard_view)

    def pieces(self, transfer: ParamTransfer) -> tuple[Piece, ...]:
        """The pieces of one parameter, ordered by HF tensor then destination.

        Raises:
            WeightSyncError: the traced conversion does not produce the planned HF shapes, or does
                not cover every HF row exactly once.
        """
        from megarl.models.mapping import lookup, template_of

        shapes = tuple(t.shape for t in transfer.param.hf)
        cuts = tuple(_section_cuts(t.sections, self.engine_tp_size) for t in transfer.param.hf)
        key = (transfer.param.name, tuple(transfer.param.shape), len(transfer.sources), shapes, cuts)
        pieces = self._pieces.get(key)
        if pieces is None:  # the name lookups cost more than the copies of a small tensor: once per parameter
            entry, _ = lookup(self.table, transfer.param.name)
            template, _ = template_of(transfer.param.name)
            pieces = self._pieces[key] = self._trace(template, entry, transfer.param.shape, len(transfer.sources),
                                                     shapes, cuts)
        return pieces

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - keyed on self too; bounded, so few placements are kept alive
    def _trace(self, template: str, entry, full_shape: tuple, num_shards: int, hf_shapes: tuple,
               cuts: tuple = ()) -> tuple[Piece, ...]:
        from megarl.models.mapping import TPSplit, split_tp, to_hf

        if entry.tp_split is TPSplit.ROW and num_shards > 1:
            if len(hf_shapes) != 1 or tuple(hf_shapes[0]) != tuple(full_shape):
                raise WeightSyncError(f"{template}: a column-split parameter must convert to one equal HF tensor")
            cols = full_shape[1] // num_shards
            return tuple(Piece(0, k, 1, (0, cols), (k * cols, (k + 1) * cols)) for k in range(num_shards))
        index = torch.arange(full_shape[0], dtype=torch.int64).view(-1, 1)
        owner = torch.empty(full_shape[0], 2, dtype=torch.int64)
        for k in range(num_shards):
            rows = split_tp(index, entry.tp_split, k, num_shards, self.layout)[:, 0]
            owner[rows, 0] = k
            owner[rows, 1] = torch.arange(rows.numel())
        outputs = to_hf(entry, index, self.layout)
        if [o.shape[0] for o in outputs] != [s[0] for s in hf_shapes] or any(
                tuple(s[1:]) != tuple(full_shape[1:]) for s in hf_shapes):
            raise WeightSyncError(f"{template}: traced conversion gives {[tuple(o.shape) for o in outputs]} rows, "
                                  f"the plan expects HF shapes {list(hf_shapes)}")
        pieces = []
        for i, out in enumerate(outputs):
            rows = out[:, 0]
            for shard, src, dst, length in _runs(owner[rows, 0], owner[rows, 1], cuts[i] if cuts else ()):
                pieces.append(Piece(i, shard, 0, (src, src + length), (dst, dst + length)))
        return tuple(pieces)


def _section_cuts(sections: tuple[int, ...], engine_tp_size: int) -> tuple[int, ...]:
    """The HF rows where an engine rank's section block starts (``s_start + r * n_s / T``); () when
    the tensor has no sections or ``T`` is 1."""
    if engine_tp_size <= 1 or not sections:
        return ()
    out, start = [], 0
    for n in sections:
        out += [start + r * (n // engine_tp_size) for r in range(engine_tp_size)]
        start += n
    return tuple(out)
