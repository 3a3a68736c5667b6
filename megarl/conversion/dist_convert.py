"""One rank of an already-launched conversion job (Slurm tasks or torchrun), either direction.

    srun -n 8 python -m megarl.conversion.dist_convert hf-to-megatron HF_DIR OUT_DIR \\
        --tensor-model-parallel-size 8                       (or: torchrun --nproc-per-node 8 -m ...)
    srun -N 4 -n 32 python -m megarl.conversion.dist_convert megatron-to-hf CKPT_DIR OUT_DIR

Where :func:`megarl.conversion.convert.hf_to_megatron` spawns its ranks itself on one machine,
here every process of the job is one rank: it joins the ``env://`` rendezvous, runs the same
per-rank function (:func:`~megarl.conversion.convert.import_rank_worker`: build the model chunks
on the meta device, fill them group by group from the safetensors, save this rank's shards) and
rank 0 publishes the directory. The job's world size must equal the layout's
(``lcm(TP*PP, ETP*EP*PP)``, no data-parallel replicas); otherwise every rank exits with status 2
before any collective.

Rendezvous, first match wins:
  * torchrun / ``slurm/lib/dist_rank.sh``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``;
  * a bare Slurm step: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; ``MASTER_ADDR``
    (default: the first host of ``scontrol show hostnames $SLURM_JOB_NODELIST``); ``MASTER_PORT``
    (default ``20000 + SLURM_JOB_ID % 20000``, the same on every task);
  * neither: one process (rank 0 of 1) on 127.0.0.1.

Backend: gloo (the conversion's collectives are on CPU tensors); with CUDA, ``auto`` gives
``cpu:gloo,cuda:nccl`` and binds the process to the GPU the project's one device rule picks
(:func:`megarl.training.devices.select_device_index`: device 0 where the task sees one GPU, as on
clusters that bind one GPU per task; ``LOCAL_RANK`` only where it sees every GPU of its node).

Atomicity: rank 0 creates the temporary sibling of OUT_DIR and broadcasts its path; after a
barrier it adds the HF metadata and renames it. A rank that fails removes nothing but makes its
peers fail (srun ``--kill-on-bad-exit``, torchrun) or time out (``--timeout-s``); a killed job can
leave a hidden ``.OUT_DIR.tmp-*`` sibling, never a partial OUT_DIR.

megatron-to-hf: any number of processes, on any number of nodes (the layout flags are not used):
each runs :func:`megarl.conversion.parallel_export.export_rank`, reading its share of the layers
and writing its own safetensors shards into the shared temporary directory; rank 0 gathers the
ranks' shards, merges the one index, adds the HF metadata and renames it (the same tensors as
``megarl convert megatron-to-hf``, byte for byte).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from megarl.conversion.convert_cli import add_import_arguments  # the flags megarl convert and the tools share
from megarl.errors import UserError
from megarl.training.devices import select_device_index


class LayoutMismatchError(UserError):
    """The job's world size differs from the number of ranks of the target layout."""


@dataclass(frozen=True)
class Rendezvous:
    """This process's place in the job (``torch.distributed`` env:// values)."""
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str
    """Where the rank came from (``RANK``, ``SLURM_PROCID`` or ``single``): for error messages."""


def _slurm_first_host(nodelist: str) -> str:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True,
                         text=True, timeout=60).stdout.split()
    if not out:
        raise RuntimeError(f"scontrol show hostnames {nodelist!r} listed no host")
    return out[0]


def _int_env(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except KeyError:
        raise ValueError(f"environment variable {name} is not set") from None
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None


def rendezvous_from_env(env: Mapping[str, str] = os.environ, *,
                        first_host: Callable[[str], str] = _slurm_first_host) -> Rendezvous:
    """Read this process's rank, world size and rendezvous address from torchrun or Slurm variables.

    Args:
        env: the environment. first_host: nodelist -> first host name (default: ``scontrol``).

    Raises:
        ValueError: a variable is missing or not an integer (names it).
    """
    if "RANK" in env or "WORLD_SIZE" in env:
        rank, world = _int_env(env, "RANK"), _int_env(env, "WORLD_SIZE")
        local = _int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        if "MASTER_ADDR" not in env:
            raise ValueError("RANK/WORLD_SIZE are set but MASTER_ADDR is not (torchrun-style env:// rendezvous)")
        return Rendezvous(rank, world, local, env["MASTER_ADDR"], _int_env(env, "MASTER_PORT"), "RANK")
    if "SLURM_PROCID" in env:
        rank, world = _int_env(env, "SLURM_PROCID"), _int_env(env, "SLURM_NTASKS")
        local = _int_env(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"])
        port = (_int_env(env, "MASTER_PORT") if "MASTER_PORT" in env
                else 20000 + _int_env(env, "SLURM_JOB_ID") % 20000)
        return Rendezvous(rank, world, local, addr, port, "SLURM_PROCID")
    from megarl.procs.local_ranks import free_port

    return Rendezvous(0, 1, 0, "127.0.0.1", free_port(), "single")


def check_world_size(rdzv: Rendezvous, layout_world: int, args: argparse.Namespace) -> None:
    """Raise :class:`LayoutMismatchError` unless the job has exactly one process per layout rank."""
    if rdzv.world_size == layout_world:
        return
    env_var = {"RANK": "WORLD_SIZE", "SLURM_PROCID": "SLURM_NTASKS"}.get(rdzv.source, "WORLD_SIZE (unset: 1)")
    layout = (f"--tensor-model-parallel-size {args.tensor_model_parallel_size} "
              f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} "
              f"--expert-model-parallel-size {args.expert_model_parallel_size} "
              f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size or args.tensor_model_parallel_size}")
    raise LayoutMismatchError(
        f"the job has {env_var}={rdzv.world_size} processes but the layout ({layout}) has {layout_world} "
        f"ranks (lcm(TP*PP, ETP*EP*PP)); launch {layout_world} tasks or change the parallel sizes")


def cuda_device_index(rdzv: Rendezvous, env: Mapping[str, str], device_count: int) -> int:
    """The CUDA device this conversion rank binds to (the trainer ranks' rule; not in a Ray actor).

    Args:
        rdzv: this rank's rendezvous (``local_rank``: ``LOCAL_RANK`` / ``SLURM_LOCALID``).
        env: the environment (``CUDA_VISIBLE_DEVICES``).
        device_count: ``torch.cuda.device_count()``.

    Raises:
        RuntimeError: the chosen index is not a device this process sees (names the values).
    """
    return select_device_index(visible_devices=env.get("CUDA_VISIBLE_DEVICES"), assigned_gpu_ids=(),
                               local_rank=rdzv.local_rank, device_count=device_count)


def _init_process_group(rdzv: Rendezvous, backend: str, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rdzv.rank), WORLD_SIZE=str(rdzv.world_size), LOCAL_RANK=str(rdzv.local_rank),
                      MASTER_ADDR=rdzv.master_addr, MASTER_PORT=str(rdzv.master_port))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    if backend == "auto" and torch.cuda.is_available():
        torch.cuda.set_device(cuda_device_index(rdzv, os.environ, torch.cuda.device_count()))
        backend = "cpu:gloo,cuda:nccl"
    elif backend == "auto":
        backend = "gloo"
    dist.init_process_group(backend, init_method="env://", rank=rdzv.rank, world_size=rdzv.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _shared_tmp_dir(out_dir: Path, overwrite: bool) -> Path:
    """Rank 0 creates the temporary sibling of ``out_dir``; every rank gets its path (or rank 0's error)."""
    import torch.distributed as dist

    from megarl.conversion.convert import _atomic_dir
    from megarl.training.collectives import broadcast_object_list

    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = str(_atomic_dir(out_dir, overwrite))
        except Exception as e:  # noqa: BLE001 - re-raised below, after the peers heard of it
            box[0] = e
    broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        if dist.get_rank() == 0:
            raise box[0]
        raise RuntimeError(f"rank 0 could not create the output directory: {box[0]}")
    return Path(box[0])


@contextlib.contextmanager
def _staged_output(rdzv: Rendezvous, args: argparse.Namespace) -> Iterator[Path]:
    """Join the process group and yield the shared staging folder beside ``args.out_dir``; on an
    error rank 0 removes the folder, and the group is destroyed however the body ends."""
    import torch.distributed as dist

    _init_process_group(rdzv, args.backend, args.timeout_s)
    try:
        tmp = _shared_tmp_dir(Path(args.out_dir), args.overwrite)
        try:
            yield tmp
        except BaseException:
            if rdzv.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_hf_to_megatron(args: argparse.Namespace, rdzv: Rendezvous) -> Path | None:
    """This rank's part of the conversion; returns the published directory on rank 0, else None.

    Raises:
        LayoutMismatchError: world size != layout ranks (before any collective, on every rank).
        As :func:`megarl.conversion.convert.hf_to_megatron` otherwise.
    """
    from megarl.conversion.convert import _publish, finish_import, import_rank_worker, plan_import
    from megarl.training.collectives import barrier

    plan = plan_import(args.hf_dir, tensor_model_parallel_size=args.tensor_model_parallel_size,
                       pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                       expert_model_parallel_size=args.expert_model_parallel_size,
                       expert_tensor_parallel_size=args.expert_tensor_parallel_size,
                       virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
                       make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, precision=args.precision)
    check_world_size(rdzv, plan.world_size, args)
    with _staged_output(rdzv, args) as tmp:
        import_rank_worker(rdzv.rank, rdzv.world_size, *plan.worker_args(tmp))
        barrier()
        if rdzv.rank != 0:
            return None
        finish_import(plan, tmp)
        return _publish(tmp, Path(args.out_dir))


def run_megatron_to_hf(args: argparse.Namespace, rdzv: Rendezvous) -> Path | None:
    """This rank's share of the export; returns the published directory on rank 0, else None.

    Raises:
        As :func:`megarl.conversion.convert.megatron_to_hf_dir` (checked on every rank before any
        collective).
    """
    from megarl.conversion.convert import _checked_export_config, _publish, copy_hf_metadata, resolve_checkpoint_dir
    from megarl.conversion.convert_cli import PRECISION_DTYPES
    from megarl.conversion.parallel_export import export_rank, write_merged_index
    from megarl.training.collectives import all_gather_object

    ckpt_dir = resolve_checkpoint_dir(Path(args.hf_dir).resolve())
    config_dir = _checked_export_config(ckpt_dir, args.hf_config)
    dtype = PRECISION_DTYPES[args.precision] if args.precision else None
    with _staged_output(rdzv, args) as tmp:
        part = export_rank(rdzv.rank, rdzv.world_size, str(ckpt_dir), str(tmp), str(config_dir), dtype,
                           int(args.max_shard_size_gb * 2**30))
        parts = all_gather_object(part)  # after every rank closed its files
        if rdzv.rank != 0:
            return None
        write_merged_index(tmp, parts)
        copy_hf_metadata(config_dir, tmp)
        return _publish(tmp, Path(args.out_dir))


def build_parser() -> argparse.ArgumentParser:
    """The command line (the layout flags of ``megarl convert`` / tools/convert_hf_to_megatron.py)."""
    parser = argparse.ArgumentParser(prog="python -m megarl.conversion.dist_convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("direction", choices=["hf-to-megatron", "megatron-to-hf"])
    parser.add_argument("hf_dir", metavar="SRC")
    parser.add_argument("out_dir", metavar="DST")
    add_import_arguments(parser)
    parser.add_argument("--backend", choices=["auto", "gloo"], default="auto",
                        help="auto: gloo, plus nccl for CUDA tensors when CUDA is available")
    parser.add_argument("--hf-config", default=None,
                        help="megatron-to-hf: HF directory with config.json and tokenizer (default: SRC's hf_config/)")
    parser.add_argument("--max-shard-size-gb", type=float, default=5.0, help="megatron-to-hf: shard size limit")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--timeout-s", type=float, default=3600.0,
                        help="collective timeout (a dead peer ends the others after this long)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; exit status 0, 2 (bad arguments, layout/world mismatch), 1 (conversion failed)."""
    args = build_parser().parse_args(argv)
    run = run_megatron_to_hf if args.direction == "megatron-to-hf" else run_hf_to_megatron
    try:
        rdzv = rendezvous_from_env()
        out = run(args, rdzv)
    except (ValueError, FileExistsError, FileNotFoundError) as e:  # bad input: layout, env, config, paths
        print(f"dist_convert: {e}", file=sys.stderr)
        return 2
    if out is not None:
        print(f"rank 0 of {rdzv.world_size}: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
