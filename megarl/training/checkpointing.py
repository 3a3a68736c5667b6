"""Trainer checkpoints with Megatron ``dist_checkpointing``: resumable at another parallel layout.

One checkpoint directory holds:

- ``model`` (``model{i}`` per virtual-pipeline chunk): each chunk's ``sharded_state_dict()``; every
  tensor is stored once, by global shape and offset, so any TP / PP / EP / DP layout can load it.
- ``optimizer``: Megatron's optimizer ``sharded_state_dict`` in the ``fully_reshardable`` format
  (Adam moments and fp32 main weights per parameter, reshardable like the model), with the chained
  dense / expert optimizers un-prefixed (``chained_optim_avoid_prefix``).
- common state (rank 0): ``scheduler`` (``OptimizerParamScheduler.state_dict()``), ``step``
  (optimizer steps taken) and ``layout`` (the parallel sizes at save time).
- ``rng_state``: each rank's Python / NumPy / torch (and CUDA) generators and Megatron's RNG-tracker
  states, one shard per global rank. RNG states belong to a rank of a layout; they are restored only
  when the checkpoint is loaded at the same layout and skipped (with a log line) otherwise.

Saving and loading are collective: every trainer rank calls them.
"""
from __future__ import annotations

import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from megarl.training.collectives import barrier

logger = logging.getLogger(__name__)

SHARDING_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
"""``metadata`` for the optimizer's ``sharded_state_dict`` (saved and loaded the same way)."""


def _layout(trainer) -> dict[str, int]:
    p = trainer.parallel
    return {"world_size": p.world_size, "tp_size": p.tp_size, "pp_size": p.pp_size, "ep_size": p.ep_size,
            "etp_size": p.etp_size, "cp_size": p.cp_size, "vpp_size": p.vpp_size or 1}


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _model_state(trainer) -> dict:
    chunks = [chunk.module if hasattr(chunk, "module") else chunk for chunk in trainer.model_chunks]
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def _prime_adam_state(optimizer) -> None:
    """Give every parameter of a never-stepped torch Adam a zero state with ``step = 0``.

    Without Apex or Transformer Engine (any CPU run), Megatron-Core 0.16.1's
    ``DistributedOptimizer.state_dict()`` reads ``step`` from torch Adam's per-parameter state and
    asserts it exists, so a freshly built optimizer can neither describe the state it is about to
    load (the zeros are overwritten by the load) nor save itself. Zero moments at ``step = 0`` are
    exactly what Adam's first step starts from, so priming does not change the next update.
    """
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(megatron_optimizer, "optimizer", None)
        if not isinstance(torch_optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                state = torch_optimizer.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                    state["step"] = torch.zeros((), dtype=torch.float32)


def _load_optimizer_state(optimizer, state_dict: dict) -> None:
    """``optimizer.load_state_dict`` with a work-around for torch Adam in the distributed optimizer.

    Megatron-Core 0.16.1 without Apex / Transformer Engine (torch Adam keeps a per-parameter
    ``step``): ``DistributedOptimizer.load_state_dict`` first restores ``step`` into every
    parameter's state, then copies the loaded per-parameter tensors over *all* state keys and
    fails with ``KeyError: 'step'`` (the reshardable formats store ``step`` once, in the param
    groups), and it gives every parameter the *same* ``step`` tensor, which torch Adam increments in
    place once per parameter. Here the two halves run separately, ``step`` is set aside around the
    second and each parameter gets its own copy.
    Other versions, or with Apex / TE, use Megatron's own method unchanged.
    """
    import megatron.core
    from megatron.core.optimizer import distrib_optimizer as mdo

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    if (megatron.core.__version__ != "0.16.1" or mdo.HAVE_APEX_OR_TE
            or not any(isinstance(o, mdo.DistributedOptimizer) for o in chained)):
        optimizer.load_state_dict(state_dict)
        return
    states = [state_dict] if len(chained) == 1 else [v for _, v in sorted(state_dict.items())]
    for inner, state in zip(chained, states, strict=True):
        if not isinstance(inner, mdo.DistributedOptimizer) or "param_state" not in state:
            inner.load_state_dict(state)
            continue
        state = dict(state)
        param_state = state.pop("param_state")
        kind = state.pop("param_state_sharding_type")
        inner.load_state_dict(state)
        steps = {param: st.pop("step") for param, st in inner.optimizer.state.items() if "step" in st}
        getattr(inner, f"load_parameter_state_from_{_LOADERS[kind]}")(param_state)
        for param, step in steps.items():
            # one tensor each: Megatron puts one shared ``step`` tensor into every parameter's
            # state, and torch Adam's ``step += 1`` (in place, per parameter) would then advance it
            # once per parameter per optimizer step (wrong bias correction after a resume, and
            # chained optimizers whose steps differ by their parameter counts)
            inner.optimizer.state[param]["step"] = step.clone() if isinstance(step, torch.Tensor) else step
    if len(chained) > 1 and hasattr(optimizer, "_synchronize_steps"):
        optimizer._synchronize_steps()


_LOADERS = {"fully_reshardable": "fully_reshardable", "dp_reshardable": "dp_reshardable",
            "fully_sharded_model_space": "fs_model_space", "dp_zero_gather_scatter": "dp_zero"}


def _sharded_state(trainer, *, is_loading: bool, with_rng: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = _model_state(trainer)
    state["optimizer"] = trainer.optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=SHARDING_METADATA)
    state["scheduler"] = trainer.scheduler.state_dict()
    state["step"] = trainer.step
    state["layout"] = _layout(trainer)
    if with_rng:
        p = trainer.parallel
        state["rng_state"] = ShardedObject("rng_state", _rng_state(), (p.world_size,), (p.rank,), replica_id=0)
    return state


def save_trainer_state(directory: str, trainer) -> None:
    """Save the trainer's model, optimizer, scheduler, RNG and step into ``directory``.

    Args:
        directory: checkpoint directory (created; must not hold another checkpoint).
        trainer: the `megarl.training.trainer.Trainer` of this rank.
    """
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    barrier()
    _prime_adam_state(trainer.optimizer)  # a never-stepped optimizer (e.g. every group filtered) saves zeros
    dist_checkpointing.save(_sharded_state(trainer, is_loading=False, with_rng=True), directory)
    barrier()


def load_trainer_state(directory: str, trainer) -> None:
    """Load a checkpoint written by `save_trainer_state`, at this trainer's (any) parallel layout.

    Args:
        directory: the checkpoint directory.
        trainer: a built trainer (model, optimizer and scheduler of the same model and kinds).

    Raises:
        FileNotFoundError: ``directory`` is not a checkpoint.
        RuntimeError: the checkpoint lacks parameters of this model (missing keys are named).
    """
    from megatron.core import dist_checkpointing

    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no checkpoint directory {directory}")
    common = dist_checkpointing.load_common_state_dict(directory)
    same_layout = common.get("layout") == _layout(trainer)
    if not same_layout:
        logger.info("checkpoint layout %s differs from %s: RNG states not restored", common.get("layout"),
                    _layout(trainer))
    _prime_adam_state(trainer.optimizer)
    loaded = dist_checkpointing.load(_sharded_state(trainer, is_loading=True, with_rng=same_layout), directory)
    chunks = [chunk.module if hasattr(chunk, "module") else chunk for chunk in trainer.model_chunks]
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for chunk, key in zip(chunks, keys):
        result = chunk.load_state_dict(loaded[key], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing:
            raise RuntimeError(f"checkpoint {directory} lacks model parameters: {missing[:5]}")
    _load_optimizer_state(trainer.optimizer, loaded["optimizer"])
    trainer.scheduler.load_state_dict(loaded["scheduler"])
    trainer.step = int(loaded["step"])
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    barrier()
