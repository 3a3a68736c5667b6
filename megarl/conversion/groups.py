"""Per-rank work of the directory converters: meta-device model chunks processed group by group.

A *group* is the embedding, one transformer layer, or the final norm + output layer of one model
chunk. Only the current group's parameters are materialised on CPU (Parameter objects keep their
identity and Megatron's attributes), filled, saved or exported, and returned to the meta device.
Two groups are in flight: group k is read in the rank's main thread while group k-1 is written
by one background thread (the DCP save with its collectives, or the safetensors writes); their
storages come from a :class:`~megarl.conversion.fastio.StoragePool`, so memory pages are touched
once per conversion, not once per layer. The export's ranks (its split of the groups over ranks,
each writing its own shards) are in :mod:`megarl.conversion.parallel_export`.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from megarl.training.collectives import all_reduce


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


def _swap_device(param: torch.nn.Parameter, device: str, pool=None, group=None) -> None:
    attrs = dict(param.__dict__)
    data = (pool.empty(param.shape, param.dtype, group) if pool is not None and device == "cpu"
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


def materialize(modules, pool=None, group=None) -> list[torch.nn.Parameter]:
    """Give the modules' meta parameters CPU storage (uninitialised; from ``pool``, a
    :class:`~megarl.conversion.fastio.StoragePool`, lent to ``group``, when given)."""
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    for p in params:
        _swap_device(p, "cpu", pool, group)
    return params


def dematerialize(params, pool=None, group=None) -> None:
    """Return the parameters to the meta device (and their storages to the pool)."""
    for p in params:
        _swap_device(p, "meta")
    if pool is not None:
        pool.release(group)


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

    def keep(key, value):  # (another group may be materialised too while it is being saved)
        data = getattr(value, "data", None)
        if torch.is_tensor(data) and materialized_only and data.is_meta:
            return False
        return key.startswith(prefixes)
    with _only_layers(chunk, modules):
        return {k: v for k, v in chunk.sharded_state_dict(prefix=prefix).items() if keep(k, v)}


def _local_infos(chunks, parallel_state, layout):
    """{(chunk index, local name): ParamInfo}."""
    from megarl.models.params import iter_global_params

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
    """:func:`~megarl.conversion.load_hf.load_param` without intermediate tensors (HF rows read
    straight into the parameter); False when that does not apply."""
    import dataclasses

    from megarl.conversion.fastio import read_hf_into
    from megarl.models.mapping import hf_names_for

    rank, size = (ps.etp_rank, ps.etp_size) if info.expert else (ps.tp_rank, ps.tp_size)
    names = hf_names_for(info.global_name, layout) or ["model.embed_tokens.weight"]  # tied output
    if info.entry.transform.value == "vocab":
        layout = dataclasses.replace(layout, padded_vocab_size=param.shape[0] * size)
    return read_hf_into(param.data, reader, names, info.entry, layout, rank, size)


def import_rank(hf_dir: str, out_dir: str, parallel_cfg, model_cfg, precision: str) -> None:
    """One rank of ``hf_to_megatron``: fill and save this rank's groups step by step."""
    from megarl.conversion.dist_ckpt import StreamingCheckpointWriter
    from megarl.conversion.fastio import StoragePool
    from megarl.conversion.hf_io import HFCheckpointReader
    from megarl.conversion.load_hf import load_param
    from megarl.models.families import get_family
    from megarl.training.model import build_model, load_hf_config
    from megarl.training.parallel_state import destroy_parallel, initialize_parallel

    ps = initialize_parallel(parallel_cfg, backend="gloo")
    hf_config = load_hf_config(hf_dir)
    chunks = build_model(hf_config, parallel_cfg, model_cfg, precision=precision, device="meta", spec="local")
    layout = get_family(hf_config).layout(hf_config,
                                          make_vocab_size_divisible_by=model_cfg.make_vocab_size_divisible_by,
                                          tp_size=ps.tp_size)
    if any(not p.is_meta for chunk in chunks for p in chunk.parameters()):
        raise RuntimeError("the converter's model was not built on the meta device")
    infos = _local_infos(chunks, ps, layout)
    reader = HFCheckpointReader(hf_dir)
    groups = module_groups(chunks)
    num_steps = torch.tensor([len(groups)])
    all_reduce(num_steps, op=dist.ReduceOp.MAX)
    writer, pool, background = StreamingCheckpointWriter(out_dir), StoragePool(), _Background()
    try:  # group k is read (here) while group k-1 is saved (in the background thread)
        for step in range(int(num_steps)):
            if step >= len(groups):
                background.submit(writer.save_step, {})
                continue
            index, modules = groups[step]
            params = materialize(modules, pool, step)
            for name, param in _group_params(chunks[index], params):
                if not _load_param_direct(infos[(index, name)], param, reader, layout, ps):
                    load_param(infos[(index, name)], param, reader, layout, ps, assign=True)
            # The state dict is handed over in a box that the save empties: no reference to the
            # parameters may remain when they go back to the meta device (swap_tensors checks).
            background.submit(_save_boxed, writer, [group_sharded_state_dict(chunks[index], modules)],
                              done=functools.partial(dematerialize, params, pool, step))
            del params
        background.drain()
    finally:
        background.shutdown()
    _release_memory()
    writer.finalize()
    reader.close()
    destroy_parallel()


def _save_boxed(writer, box: list) -> None:
    writer.save_step(box.pop())


class _Background:
    """Runs tasks in order in one background thread, at most one queued behind the running one:
    :meth:`submit` returns once the task before the new one has finished (its error is raised
    here) and its ``done`` callback has run in the caller's thread."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self._executor = ThreadPoolExecutor(1, thread_name_prefix="megarl-convert-io")
        self._pending: list = []

    def submit(self, fn, *args, done=None) -> None:
        self._pending.append((self._executor.submit(fn, *args), done))
        while len(self._pending) > 1:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        future, done = self._pending.pop(0)
        future.result()
        if done is not None:
            done()

    def drain(self) -> None:
        """Wait for every task."""
        while self._pending:
            self._finish_oldest()

    def shutdown(self) -> None:
        """Stop without waiting (after an error the running task may wait on a failed peer)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
