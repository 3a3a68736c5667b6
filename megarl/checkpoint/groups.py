"""Per-rank work of the directory converters: meta-device model chunks processed group by group.

A *group* is the embedding, one transformer layer, or the final norm + output layer of one model
chunk. Only the current group's parameters are materialised on CPU (Parameter objects keep their
identity and Megatron's attributes), filled, saved or exported, and returned to the meta device.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist


def module_groups(chunks) -> list[tuple[int, list[torch.nn.Module]]]:
    """``(chunk index, modules)`` per group, in model order."""
    groups = []
    for index, chunk in enumerate(chunks):
        if getattr(chunk, "pre_process", False):
            groups.append((index, [chunk.embedding]))
        groups.extend((index, [layer]) for layer in chunk.decoder.layers)
        post = [m for m in (getattr(chunk.decoder, "final_layernorm", None),
                            getattr(chunk, "output_layer", None) if chunk.post_process else None)
                if m is not None and any(True for _ in m.parameters())]
        if post:
            groups.append((index, post))
    covered = sum(sum(p.numel() for m in mods for p in m.parameters()) for _, mods in groups)
    total = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    if covered != total:
        raise RuntimeError(f"module groups cover {covered} of {total} parameter elements")
    return groups


def _swap_device(param: torch.nn.Parameter, device: str, pool=None) -> None:
    attrs = dict(param.__dict__)
    data = (pool.empty(param.shape, param.dtype) if pool is not None and device == "cpu"
            else torch.empty(param.shape, dtype=param.dtype, device=device))
    new = torch.nn.Parameter(data, requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, new)
    param.__dict__.update(attrs)


def _release_memory() -> None:
    """Return freed heap pages to the OS (glibc keeps them otherwise; peak RSS would creep up)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def materialized(modules, pool=None):
    """Give the modules' meta parameters CPU storage (uninitialised) for the duration; with a
    :class:`~megarl.checkpoint.fastio.StoragePool` the storages come from (and go back to) it."""
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    for p in params:
        _swap_device(p, "cpu", pool)
    yield params  # on an exception the parameters stay materialised (the process is failing)
    for p in params:
        _swap_device(p, "meta")
    del params, p
    if pool is not None:
        pool.next_generation()
    _release_memory()


@contextlib.contextmanager
def _only_layers(chunk, modules):
    """Let ``chunk.decoder.layers`` hold only the group's layer (or none) for the duration, so that
    ``chunk.sharded_state_dict()`` costs O(group), not O(model). Keys are unchanged: Megatron
    derives a layer's key from its ``layer_number``, not its list position."""
    decoder = chunk.decoder
    original = decoder.layers
    decoder.layers = torch.nn.ModuleList([m for m in modules if any(m is layer for layer in original)])
    try:
        yield
    finally:
        decoder.layers = original


def group_sharded_state_dict(chunk, modules, prefix: str = "", *, materialized_only: bool = True) -> dict:
    """The entries of ``chunk.sharded_state_dict(prefix)`` that belong to ``modules``.

    With ``materialized_only`` tensors on the meta device are dropped (the group's own tensors are
    the materialised ones); otherwise tensor entries are kept by their module path, like the
    non-tensor entries (``_extra_state``).
    """
    paths = {id(m): name for name, m in chunk.named_modules()}
    prefixes = tuple(prefix + paths[id(m)] + "." for m in modules)

    def keep(key, value):
        data = getattr(value, "data", None)
        if torch.is_tensor(data) and materialized_only:
            return not data.is_meta
        return key.startswith(prefixes)
    with _only_layers(chunk, modules):
        return {k: v for k, v in chunk.sharded_state_dict(prefix=prefix).items() if keep(k, v)}


def _local_infos(chunks, parallel_state, layout):
    """{(chunk index, local name): ParamInfo}."""
    from megarl.checkpoint.loader import iter_global_params

    infos = {}
    for index, chunk in enumerate(chunks):
        names = [n for n, _ in chunk.named_parameters()]
        for name, (info, _) in zip(names, iter_global_params([chunk], parallel_state, layout)):
            infos[(index, name)] = info
    return infos


def _group_params(chunk, params):
    ids = {id(p) for p in params}
    return [(n, p) for n, p in chunk.named_parameters() if id(p) in ids]


def _load_param_direct(info, param, reader, layout, ps) -> bool:
    """:func:`~megarl.checkpoint.loader.load_param` without intermediate tensors (HF rows read
    straight into the parameter); False when that does not apply."""
    import dataclasses

    from megarl.checkpoint.fastio import read_hf_into
    from megarl.checkpoint.mapping import hf_names_for

    rank, size = (ps.etp_rank, ps.etp_size) if info.expert else (ps.tp_rank, ps.tp_size)
    names = hf_names_for(info.global_name, layout) or ["model.embed_tokens.weight"]  # tied output
    if info.entry.transform.value == "vocab":
        layout = dataclasses.replace(layout, padded_vocab_size=param.shape[0] * size)
    return read_hf_into(param.data, reader, names, info.entry, layout, rank, size)


def import_rank(hf_dir: str, out_dir: str, parallel_cfg, model_cfg, precision: str) -> None:
    """One rank of ``hf_to_megatron``: fill and save this rank's groups step by step."""
    from megarl.checkpoint.dist_ckpt import StreamingCheckpointWriter
    from megarl.checkpoint.fastio import StoragePool
    from megarl.checkpoint.families import get_family
    from megarl.checkpoint.hf_io import HFCheckpointReader
    from megarl.checkpoint.loader import load_param
    from megarl.training.model import build_model, load_hf_config
    from megarl.training.parallel_state import destroy_parallel, initialize_parallel

    ps = initialize_parallel(parallel_cfg, backend="gloo")
    hf_config = load_hf_config(hf_dir)
    chunks = build_model(hf_config, parallel_cfg, model_cfg, precision=precision, device="meta", spec="local")
    layout = get_family(hf_config).layout(hf_config, make_vocab_size_divisible_by=model_cfg.make_vocab_size_divisible_by,
                                          tp_size=ps.tp_size)
    if any(not p.is_meta for chunk in chunks for p in chunk.parameters()):
        raise RuntimeError("the converter's model was not built on the meta device")
    infos = _local_infos(chunks, ps, layout)
    reader = HFCheckpointReader(hf_dir)
    groups = module_groups(chunks)
    num_steps = torch.tensor([len(groups)])
    dist.all_reduce(num_steps, op=dist.ReduceOp.MAX)
    writer, pool = StreamingCheckpointWriter(out_dir), StoragePool()
    for step in range(int(num_steps)):
        if step >= len(groups):
            writer.save_step({})
            continue
        index, modules = groups[step]
        with materialized(modules, pool) as params:
            for name, param in _group_params(chunks[index], params):
                if not _load_param_direct(infos[(index, name)], param, reader, layout, ps):
                    load_param(infos[(index, name)], param, reader, layout, ps, assign=True)
            writer.save_step(group_sharded_state_dict(chunks[index], modules))
    writer.finalize()
    reader.close()
    destroy_parallel()


def _hf_fp32_modules(hf_config) -> set[str]:
    """Module names transformers keeps in fp32 whatever the model dtype
    (``_keep_in_fp32_modules_strict``, e.g. DeepSeek-V3's ``e_score_correction_bias``)."""
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping.get(type(hf_config), None)
    return set(getattr(model_class, "_keep_in_fp32_modules_strict", None) or ())


def export_rank(ckpt_dir: str, out_dir: str, config_dir: str, dtype, max_shard_bytes: int) -> None:
    """The (single) process of ``megatron_to_hf_dir``."""
    from megarl.checkpoint import hf_io
    from megarl.checkpoint.dist_ckpt import CheckpointReader, model_prefix, tensor_shapes
    from megarl.checkpoint.fastio import StoragePool
    from megarl.checkpoint.families import get_family
    from megarl.checkpoint.mapping import megatron_to_hf
    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.training.model import build_model, load_hf_config
    from megarl.training.parallel_state import destroy_parallel, initialize_parallel

    shapes = tensor_shapes(ckpt_dir)
    prefix = model_prefix(shapes)
    hf_config = load_hf_config(config_dir)
    (padded_vocab, _), ckpt_dtype = shapes[prefix + "embedding.word_embeddings.weight"]
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[ckpt_dtype]
    out_dtype = getattr(torch, dtype) if dtype else ckpt_dtype
    ps = initialize_parallel(ParallelConfig(), backend="gloo")
    chunks = build_model(hf_config, ParallelConfig(), ModelConfig(make_vocab_size_divisible_by=padded_vocab),
                         precision=precision, device="meta", spec="local")
    layout = get_family(hf_config).layout(hf_config, make_vocab_size_divisible_by=padded_vocab)
    infos = _local_infos(chunks, ps, layout)
    groups = module_groups(chunks)
    reader, pool = CheckpointReader(ckpt_dir), StoragePool()

    def hf_tensors(index, named):
        pairs = [(infos[(index, n)].global_name, p) for n, p in named]
        return megatron_to_hf(pairs, layout)

    # Importing the modeling module costs ~1 s; it only matters when the output is not fp32.
    fp32_modules = _hf_fp32_modules(hf_config) if out_dtype != torch.float32 else set()

    def dtype_of(name):
        return torch.float32 if fp32_modules & set(name.split(".")) else out_dtype

    planned = [(name, dtype_of(name), tuple(t.shape)) for index, modules in groups
               for name, t in hf_tensors(index, _group_params(chunks[index], [p for m in modules for p in m.parameters()]))]
    shards = hf_io.plan_shards(planned, max_shard_bytes)
    files = hf_io.shard_file_names(len(shards))
    writers = iter([(f, s) for f, s in zip(files, shards)])
    current, remaining = None, 0
    for index, modules in groups:
        # Shape-only (meta) ShardedTensors describe what to read; the reader allocates the data.
        wanted = group_sharded_state_dict(chunks[index], modules, prefix=prefix, materialized_only=False)
        loaded = {k[len(prefix):]: v for k, v in reader.load(wanted, allocate=pool.empty).items()}
        named = _group_params(chunks[index], [p for m in modules for p in m.parameters()])
        for name, tensor in hf_tensors(index, [(n, loaded[n]) for n, _ in named]):
            if remaining == 0:
                if current is not None:
                    current.close()
                file, shard = next(writers)
                current, remaining = hf_io.SafetensorsStreamWriter(Path(out_dir) / file, shard), len(shard)
            current.write(name, tensor.to(dtype_of(name)))
            remaining -= 1
        del wanted, loaded, named
        pool.next_generation()  # this group's tensors are written: the next group reuses them
        _release_memory()
    if current is not None:
        current.close()
    hf_io.write_index(Path(out_dir), shards, files)
    reader.close()
    destroy_parallel()
