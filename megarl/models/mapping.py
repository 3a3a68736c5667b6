"""Hugging Face <-> Megatron-Core parameter mapping: names, tensor transforms, TP sharding.

A model family (``megarl.models.families``) declares one table from Megatron parameter-name
templates to :class:`Entry` values: the HF tensor names, the transform between the HF tensors and
the one Megatron tensor, and how Megatron shards that tensor over tensor parallelism. This module
interprets such tables; it knows no family.

Names. Megatron names are *global, canonical, checkpoint-style module names* of one ``GPTModel``:
``decoder.layers.{L}.…`` with the global layer index ``L`` (not the index inside a pipeline stage
or virtual chunk) and, for experts, the global expert index ``E`` in
``mlp.experts.local_experts.{E}.…``. Canonical = the local spec's names; Transformer Engine names
(fused ``layer_norm_weight``, grouped-GEMM ``linear_fc1.weight{E}``) map to them
(:mod:`megarl.models.naming`). :func:`global_name` turns a rank's local parameter name of either
spec into it; tables hold canonical names only.

Tensors. "Full" Megatron tensors are unsharded over TP/ETP, in Megatron's layout: ``linear_qkv``
rows grouped per query group ``[q_g (heads_per_group*head_dim); k_g (head_dim); v_g (head_dim)]``
for each group g; GLU ``linear_fc1`` rows ``[gate; up]``; embedding / output rows padded to
``padded_vocab_size``. :func:`split_tp` / :func:`gather_tp` convert between full tensors and
per-rank shards (``gather_tp`` is what a weight sync applies to shards it all-gathered).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

# The table's types live in a leaf module (the families import them without importing this one).
from megarl.models.naming import TE_TO_CANONICAL, canonical_template
from megarl.models.table import (  # noqa: F401
    Entry,
    FamilyTransform,
    ModelLayout,
    TPSplit,
    Transform,
    padded_vocab_size,
)


def _grouped_kind(part: str) -> str:
    """``weight`` / ``bias`` for a name part ``weight7`` / ``bias7`` (TE GroupedLinear), else ``""``."""
    for kind in ("weight", "bias"):
        if part.startswith(kind) and part[len(kind):].isdigit():
            return kind
    return ""


def template_of(name: str) -> tuple[str, dict[str, int]]:
    """Split a concrete name into its template and indices.

    ``decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight`` ->
    (``decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight``, {L: 3, E: 5});
    ``….experts.linear_fc2.weight7`` -> (``….experts.linear_fc2.weight{E}``, {E: 7}).
    """
    parts, values = [], {}
    for part in name.split("."):
        if part.isdigit():
            key = "L" if "L" not in values else "E"
            values[key] = int(part)
            parts.append("{" + key + "}")
        elif _grouped_kind(part):  # TEGroupedMLP's weight{E} / bias{E}
            kind = _grouped_kind(part)
            values["E"] = int(part[len(kind):])
            parts.append(kind + "{E}")
        else:
            parts.append(part)
    return ".".join(parts), values


def canonical_name(name: str) -> str:
    """The canonical (local-spec) name of a Megatron parameter name of either spec.

    Indices are kept: ``decoder.layers.3.mlp.experts.linear_fc1.weight5`` ->
    ``decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight``;
    ``decoder.layers.3.self_attention.linear_qkv.layer_norm_weight`` ->
    ``decoder.layers.3.input_layernorm.weight``. Works on rank-local and global names alike.
    """
    template, values = template_of(name)
    canonical = TE_TO_CANONICAL.get(template)
    return name if canonical is None else canonical.format(**values)


def lookup(table: Mapping[str, Entry], name: str) -> tuple[Entry, dict[str, int]]:
    """The table entry of a concrete Megatron name and its indices.

    Names of either layer spec are accepted (Transformer Engine names are looked up under their
    canonical name, :mod:`megarl.models.naming`).

    Raises:
        KeyError: the name is not in the table.
    """
    template, values = template_of(name)
    template = canonical_template(template)
    if template not in table:
        raise KeyError(f"no HF mapping for Megatron parameter {name!r} (template {template!r})")
    return table[template], values


def hf_names(entry: Entry, values: Mapping[str, int]) -> list[str]:
    """The concrete HF names of an entry."""
    return [t.format(**values) for t in entry.hf]


def hf_names_for(megatron_name: str, layout: ModelLayout,
                 table: Mapping[str, Entry] | None = None) -> list[str]:
    """The HF tensor names a global Megatron parameter is made of (``[]`` for the output layer
    when embeddings are tied: it is the embedding).

    Raises:
        KeyError: a name with no mapping.
    """
    entry, values = lookup(table if table is not None else family_table(layout), megatron_name)
    if layout.tie_word_embeddings and megatron_name == "output_layer.weight":
        return []
    return hf_names(entry, values)


def family_table(layout: ModelLayout) -> Mapping[str, Entry]:
    """The mapping table of ``layout.family``."""
    from megarl.models.families import get_family

    return get_family(layout.family).table


def to_megatron(entry: Entry, hf_tensors: Sequence[torch.Tensor], layout: ModelLayout) -> torch.Tensor:
    """Build the full Megatron tensor from the entry's HF tensors (in ``entry.hf`` order); a family's own
    transform (:class:`FamilyTransform`) through its function."""
    if isinstance(entry.transform, FamilyTransform):
        return entry.transform.to_megatron(hf_tensors, layout)
    if entry.transform is Transform.COPY:
        return hf_tensors[0]
    if entry.transform is Transform.GLU:
        return torch.cat(list(hf_tensors), dim=0)
    if entry.transform is Transform.TRANSPOSE:
        return hf_tensors[0].t()
    if entry.transform is Transform.GLU_INTERLEAVED_T:
        t = hf_tensors[0]
        return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1).t() if t.dim() == 2 else torch.cat([t[0::2], t[1::2]])
    if entry.transform is Transform.VOCAB:
        t = hf_tensors[0]
        if t.shape[0] > layout.padded_vocab_size:
            raise ValueError(f"vocabulary rows {t.shape[0]} exceed padded size {layout.padded_vocab_size}")
        pad = t.new_zeros((layout.padded_vocab_size - t.shape[0],) + tuple(t.shape[1:]))
        return torch.cat([t, pad], dim=0)
    if entry.transform is Transform.GDN_IN_PROJ:
        return torch.cat(list(hf_tensors), dim=0)
    q, k, v = hf_tensors
    groups, hd = layout.num_query_groups, layout.head_dim
    per_group = layout.num_attention_heads // groups
    cols = q.shape[1:]
    if entry.transform is Transform.QKV_GATED:  # q_proj rows per head: [q_h; gate_h]
        q_and_gate = q.reshape(groups, per_group, 2, hd, *cols)
        parts = [q_and_gate[:, :, 0].reshape(groups, per_group * hd, *cols),
                 q_and_gate[:, :, 1].reshape(groups, per_group * hd, *cols)]
    else:
        parts = [q.reshape(groups, per_group * hd, *cols)]
    fused = torch.cat([*parts, k.reshape(groups, hd, *cols), v.reshape(groups, hd, *cols)], dim=1)
    return fused.reshape(-1, *cols)


def to_hf(entry: Entry, full: torch.Tensor, layout: ModelLayout) -> list[torch.Tensor]:
    """Split a full Megatron tensor into the entry's HF tensors (in ``entry.hf`` order); a family's own
    transform (:class:`FamilyTransform`) through its function."""
    if isinstance(entry.transform, FamilyTransform):
        return entry.transform.to_hf(full, layout)
    if entry.transform is Transform.COPY:
        return [full]
    if entry.transform is Transform.GLU:
        return list(full.chunk(2, dim=0))
    if entry.transform is Transform.TRANSPOSE:
        return [full.t().contiguous()]
    if entry.transform is Transform.GLU_INTERLEAVED_T:  # [gate; up] rows -> gate, up alternating
        interleaved = torch.stack(full.chunk(2, dim=0), dim=1).reshape(full.shape)
        return [interleaved.t().contiguous() if full.dim() == 2 else interleaved]
    if entry.transform is Transform.VOCAB:  # several names: one tied tensor sent under each
        return [full[: layout.vocab_size]] * len(entry.hf)
    if entry.transform is Transform.GDN_IN_PROJ:  # [q; k; v | z | beta | alpha]
        k_dim, v_dim, heads = layout.linear_key_dim, layout.linear_value_dim, layout.linear_value_heads
        return list(full.split([2 * k_dim + v_dim, v_dim, heads, heads], dim=0))
    groups, hd = layout.num_query_groups, layout.head_dim
    per_group = layout.num_attention_heads // groups
    cols = full.shape[1:]
    if entry.transform is Transform.QKV_GATED:
        q, gate, k, v = full.reshape(groups, (2 * per_group + 2) * hd, *cols).split(
            [per_group * hd, per_group * hd, hd, hd], dim=1)
        q_and_gate = torch.stack([q.reshape(groups, per_group, hd, *cols), gate.reshape(groups, per_group, hd, *cols)],
                                 dim=2)
        return [q_and_gate.reshape(-1, *cols), k.reshape(-1, *cols), v.reshape(-1, *cols)]
    q, k, v = full.reshape(groups, (per_group + 2) * hd, *cols).split([per_group * hd, hd, hd], dim=1)
    return [q.reshape(-1, *cols), k.reshape(-1, *cols), v.reshape(-1, *cols)]


EMBEDDING, OUTPUT_LAYER = "embedding.word_embeddings.weight", "output_layer.weight"


def embedding_as_output(table: Mapping[str, Entry]) -> dict[str, Entry]:
    """The table of a tied model whose embedding is also delivered as the output layer's HF tensor.

    The embedding's entry names both HF tensors (``model.embed_tokens.weight``, ``lm_head.weight``);
    :func:`to_hf` gives the same rows under each. For an engine that keeps its own output layer
    although the checkpoint ties it (:mod:`megarl.rollout.engine_view`); HF -> Megatron reads the first.
    """
    embedding, output = table[EMBEDDING], table[OUTPUT_LAYER]
    return {**table, EMBEDDING: Entry(embedding.hf + output.hf, embedding.transform, embedding.tp_split)}


_SECTIONED = (TPSplit.GDN_IN_PROJ, TPSplit.GDN_CONV)


def split_tp(full: torch.Tensor, split: TPSplit, rank: int, size: int,
             layout: ModelLayout | None = None) -> torch.Tensor:
    """This TP rank's shard of a full Megatron tensor (a view where possible).

    ``layout`` gives the row sections of a sectioned split (:meth:`ModelLayout.tp_sections`,
    Gated DeltaNet); other splits ignore it.

    Raises:
        ValueError: the split dimension is not divisible by ``size``; a sectioned split without ``layout``.
    """
    if split is TPSplit.NONE or size == 1:
        return full
    if split is TPSplit.GLU or split in _SECTIONED:
        sections = [full.shape[0] // 2] * 2 if split is TPSplit.GLU else _sections(split, layout)
        return torch.cat([split_tp(part, TPSplit.COLUMN, rank, size)
                          for part in full.split(sections, dim=0)], dim=0)
    dim = 0 if split is TPSplit.COLUMN else 1
    if full.shape[dim] % size:
        raise ValueError(f"dim {dim} of shape {tuple(full.shape)} is not divisible by TP size {size}")
    return full.chunk(size, dim=dim)[rank]


def _sections(split: TPSplit, layout: ModelLayout | None) -> list[int]:
    if layout is None:
        raise ValueError(f"TP split {split.value} needs the model layout (its row sections)")
    return layout.tp_sections(split)


def gather_tp(shards: Sequence[torch.Tensor], split: TPSplit, layout: ModelLayout | None = None) -> torch.Tensor:
    """The full Megatron tensor from all TP ranks' shards (ordered by TP rank); ``layout`` as in
    :func:`split_tp`."""
    if split is TPSplit.NONE or len(shards) == 1:
        return shards[0]
    if split is TPSplit.GLU or split in _SECTIONED:
        count = len(shards)
        sections = ([shards[0].shape[0] // 2] * 2 if split is TPSplit.GLU
                    else [n // count for n in _sections(split, layout)])
        parts = [s.split(sections, dim=0) for s in shards]
        return torch.cat([p[i] for i in range(len(sections)) for p in parts], dim=0)
    return torch.cat(list(shards), dim=0 if split is TPSplit.COLUMN else 1)


def global_expert_id(local_expert: int, ep_rank: int, num_local_experts: int) -> int:
    """Megatron's expert placement: rank ``ep_rank`` holds experts ``[ep_rank*n, (ep_rank+1)*n)``."""
    return ep_rank * num_local_experts + local_expert


def global_name(local_name: str, *, layer_number: int | None, ep_rank: int,
                num_local_experts: int) -> str:
    """The global, canonical checkpoint-style name of a rank-local parameter name of either layer
    spec (Transformer Engine names become local-spec names: :mod:`megarl.models.naming`).

    Args:
        local_name: name from ``model_chunk.named_parameters()`` (layer index inside the chunk,
            expert index inside the rank).
        layer_number: Megatron's 1-based global ``TransformerLayer.layer_number`` of that layer
            (None for non-layer parameters).
        ep_rank: expert-parallel rank; num_local_experts: experts held by each EP rank.
    """
    template, values = template_of(local_name)
    template = canonical_template(template)
    if "L" in values:
        if layer_number is None:
            raise ValueError(f"{local_name}: a layer's parameter needs its layer_number")
        values["L"] = layer_number - 1
    if "E" in values:
        values["E"] = global_expert_id(values["E"], ep_rank, num_local_experts)
    return template.format(**values)


def megatron_to_hf(named_params: Iterable[tuple[str, torch.Tensor]], layout: ModelLayout,
                   table: Mapping[str, Entry] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Convert full Megatron tensors to HF checkpoint-style tensors, one parameter at a time.

    Args:
        named_params: ``(global Megatron name, full tensor)`` pairs: global layer / expert
            indices (see :func:`global_name`) and tensors gathered over TP/ETP with
            :func:`gather_tp` (vocabulary rows may be padded). Any subset and order.
        layout: the model's :class:`ModelLayout`.
        table: the family table (default: from ``layout.family``).

    Yields:
        ``(hf_name, tensor)`` with checkpoint-style names (per-expert
        ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``); the output layer is
        skipped when embeddings are tied. Tensors may be views of the inputs. Expert slices of a
        stacked HF tensor (``name[E]``, see :class:`Entry`) come as the stacked tensor
        ``[num_experts, ...]`` once every expert of it has been given, after the others; slices
        whose stack stays incomplete come last, under their ``name[E]``.

    Raises:
        KeyError: a name with no mapping.
    """
    table = table if table is not None else family_table(layout)
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in named_params:
        entry, values = lookup(table, name)
        if layout.tie_word_embeddings and name == "output_layer.weight":
            continue
        for hf_name, hf_tensor in zip(hf_names(entry, values), to_hf(entry, tensor, layout)):
            base, expert = expert_slice(hf_name)
            if expert is None:
                yield hf_name, hf_tensor
                continue
            pending.setdefault(base, {})[expert] = hf_tensor
            if len(pending[base]) == layout.num_experts:
                slices = pending.pop(base)
                yield base, torch.stack([slices[e] for e in range(layout.num_experts)])
    for base, slices in pending.items():
        yield from ((f"{base}[{e}]", t) for e, t in sorted(slices.items()))


def expert_slice(hf_name: str) -> tuple[str, int | None]:
    """``("model.layers.0.mlp.experts.down_proj", 3)`` for ``model.layers.0.mlp.experts.down_proj[3]``
    (expert 3's slice of a stacked HF tensor, :class:`Entry`); ``(hf_name, None)`` for any other name."""
    if hf_name.endswith("]") and "[" in hf_name:
        base, _, index = hf_name[:-1].rpartition("[")
        if index.isdigit():
            return base, int(index)
    return hf_name, None


def stack_shapes(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """HF name -> shape with expert slices ``name[E]`` replaced by their stacked tensor
    ``name: (experts, *slice shape)``."""
    out: dict[str, tuple[int, ...]] = {}
    counts: dict[str, int] = {}
    for name, shape in shapes.items():
        base, expert = expert_slice(name)
        if expert is None:
            out[name] = tuple(shape)
        else:
            counts[base] = max(counts.get(base, 0), expert + 1)
            out[base] = (counts[base], *shape)
    return out
