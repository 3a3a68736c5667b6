"""Megatron-Core parallel state, read once into a small immutable value.

``initialize_parallel(cfg.parallel, backend=...)`` starts ``torch.distributed`` (if needed), calls
Megatron's ``initialize_model_parallel`` and seeds its RNG tracker, and returns a
:class:`ParallelState`. Code outside ``megarl.training`` receives that value and never calls
Megatron's ``parallel_state`` getters (STYLE.md rule 6).

Rank order is Megatron's default ``tp-cp-ep-dp-pp`` (TP fastest-varying).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.config.device import use_cuda
from megarl.config.parallel import parallel_size_issues
from megarl.config.schema import ParallelConfig
from megarl.training.devices import local_device_index


@dataclass(frozen=True, kw_only=True)
class ParallelState:
    """This rank's coordinates in every Megatron parallel dimension (sizes are group sizes)."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of trainer ranks."""
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    vpp_size: int | None
    """Model chunks per pipeline stage (interleaved schedule); None = no interleaving."""
    ep_rank: int
    ep_size: int
    etp_rank: int
    """Rank inside the expert tensor-parallel group."""
    etp_size: int
    cp_rank: int
    cp_size: int
    dp_rank: int
    """Data-parallel rank (without context parallelism)."""
    dp_size: int
    expert_dp_rank: int
    """Rank in the expert data-parallel group (replicas of the same experts)."""
    expert_dp_size: int
    sequence_parallel: bool = False
    backend: str = "gloo"
    """``torch.distributed`` backend: ``gloo`` (CPU) or ``nccl``."""

    @property
    def is_last_stage(self) -> bool:
        """Last pipeline stage (holds the output layer and computes logits)."""
        return self.pp_rank == self.pp_size - 1

    @classmethod
    def from_megatron(cls, *, sequence_parallel: bool = False) -> ParallelState:
        """Read the state of an initialised Megatron ``parallel_state``.

        Raises:
            RuntimeError: Megatron's model parallel groups are not initialised.
        """
        from megatron.core import parallel_state as mps

        if not mps.model_parallel_is_initialized():
            raise RuntimeError("Megatron model parallel is not initialised: call initialize_parallel()")
        return cls(
            rank=dist.get_rank(), world_size=dist.get_world_size(),
            tp_rank=mps.get_tensor_model_parallel_rank(),
            tp_size=mps.get_tensor_model_parallel_world_size(),
            pp_rank=mps.get_pipeline_model_parallel_rank(),
            pp_size=mps.get_pipeline_model_parallel_world_size(),
            vpp_size=mps.get_virtual_pipeline_model_parallel_world_size(),
            ep_rank=mps.get_expert_model_parallel_rank(),
            ep_size=mps.get_expert_model_parallel_world_size(),
            etp_rank=mps.get_expert_tensor_parallel_rank(),
            etp_size=mps.get_expert_tensor_parallel_world_size(),
            cp_rank=mps.get_context_parallel_rank(), cp_size=mps.get_context_parallel_world_size(),
            dp_rank=mps.get_data_parallel_rank(), dp_size=mps.get_data_parallel_world_size(),
            expert_dp_rank=mps.get_expert_data_parallel_rank(),
            expert_dp_size=mps.get_expert_data_parallel_world_size(),
            sequence_parallel=sequence_parallel, backend=dist.get_backend())


def check_parallel_sizes(parallel_cfg: ParallelConfig, world_size: int) -> None:
    """Check that the parallel sizes fit ``world_size`` (Megatron's own checks, with field names;
    the rules are :func:`megarl.config.parallel.parallel_size_issues`, which ``megarl validate`` reports).

    Raises:
        ValueError: names the offending ``parallel.*`` field and the values involved.
    """
    p = parallel_cfg
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "expert_model_parallel_size", "context_parallel_size"):
        if getattr(p, name) < 1:
            raise ValueError(f"parallel.{name}={getattr(p, name)} must be >= 1")
    for key, message in parallel_size_issues(p, world_size, f"{world_size} (torch.distributed)"):
        raise ValueError(f"{key}: {message}")


def initialize_parallel(parallel_cfg: ParallelConfig, *, backend: str = "auto", seed: int = 1234,
                        timeout_minutes: int = 30) -> ParallelState:
    """Initialise ``torch.distributed`` (if needed) and Megatron's model-parallel groups.

    On a machine without CUDA the CPU patches of :mod:`megarl.training.cpu_compat` are applied
    first; on CUDA only ``moe_te_gemm`` (an MoE router without Transformer Engine fails there too).
    ``torch.distributed`` is started from the environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) when not already initialised. The Megatron RNG tracker is
    seeded (``model_parallel_cuda_manual_seed(seed)``; on CPU it tracks the CPU generator).

    Args:
        parallel_cfg: the ``parallel`` config section.
        backend: ``gloo``, ``nccl`` or ``auto`` (nccl with CUDA, gloo otherwise).
        seed: RNG seed (Megatron offsets it per TP / EP rank).
        timeout_minutes: timeout of Megatron's process groups.

    Returns:
        This rank's :class:`ParallelState`.

    Raises:
        ValueError: parallel sizes that do not fit the world size (names the field), or
            ``nccl`` requested without CUDA.
        RuntimeError: unsupported megatron-core version on CPU (see ``cpu_compat``).
    """
    from megatron.core import parallel_state as mps
    from megatron.core import tensor_parallel

    from megarl.training.cpu_compat import apply_cpu_patches, patch_moe_te_gemm

    cuda = use_cuda("auto")  # this process's devices: the ranks of a CUDA run see their GPU
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise ValueError("backend 'nccl' needs CUDA; use 'gloo' on CPU")
    if not cuda:
        apply_cpu_patches()
    else:  # not CPU-only: without Transformer Engine, 0.16.1's MoE router raises NameError on CUDA too
        patch_moe_te_gemm()
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(local_device_index())
        # An explicit timeout: the default group's would otherwise be torch's per-backend default,
        # not the one Megatron's groups get from ``timeout_minutes``.
        dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes))
    check_parallel_sizes(parallel_cfg, dist.get_world_size())
    p = parallel_cfg
    mps.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        distributed_timeout_minutes=timeout_minutes)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelState.from_megatron(sequence_parallel=p.sequence_parallel)


def destroy_parallel(*, destroy_process_group: bool = False) -> None:
    """Tear down Megatron's model-parallel groups (and the default process group if asked)."""
    from megatron.core import parallel_state as mps

    mps.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
