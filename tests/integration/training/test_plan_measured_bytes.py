"""`megarl plan`'s trainer memory against a real trainer's tensors on CPU.

Two gloo ranks build the tiny Qwen3-MoE trainer (Megatron-Core, DDP, the distributed optimizer,
FP32) at two layouts, take one optimizer step (Adam's states exist only after it), and sum the
bytes of what each rank holds: its parameters, its DDP gradient buffers (dense and expert), and
its optimizer states. The planner's ``weights``, ``gradients`` and ``adam_states`` for the same
layout (FP32: no separate main weights) must agree within 10% on every rank.
"""
import pytest
import torch
from megarl_trainer_cases import build, make_batch, make_cfg, teardown

from megarl.testing.multiproc import run_ranks

LAYOUTS = {
    "ep2_dp2": {"parallel.expert_model_parallel_size": 2},
    "tp2_sp_ep2_etp1": {"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": True,
                        "parallel.expert_model_parallel_size": 2, "parallel.expert_tensor_parallel_size": 1},
}


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _measured(trainer) -> dict[str, int]:
    """Bytes this rank holds: parameters, DDP gradient buffers, optimizer states."""
    params = sum(_tensor_bytes(p) for chunk in trainer.model_chunks for p in chunk.parameters())
    grads = sum(_tensor_bytes(buffer.grad_data) for chunk in trainer.model_chunks
                for buffer in chunk.buffers + chunk.expert_parallel_buffers)
    optimizers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    states = sum(_tensor_bytes(value) for opt in optimizers for state in opt.optimizer.state.values()
                 for value in state.values() if isinstance(value, torch.Tensor) and value.numel() > 1)
    return {"weights": params, "gradients": grads, "adam_states": states}


def _worker(rank, world_size, hf_dir, batch):
    out = {}
    for name, layout in LAYOUTS.items():
        trainer = build(make_cfg(hf_dir, layout))
        trainer.train_step(batch)
        out[name] = _measured(trainer)
        teardown(trainer)
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_planned_trainer_bytes_match_a_real_trainer(tiny_moe_dir):
    from transformers import AutoConfig

    from megarl.plan.memory import TrainerSetup, trainer_memory
    from megarl.plan.shape import ModelShape

    hf = AutoConfig.from_pretrained(tiny_moe_dir)
    results = run_ranks(_worker, 2, args=(str(tiny_moe_dir), make_batch(hf.vocab_size, seed=5)), timeout_s=540)
    shape = ModelShape.from_hf_config(hf)
    for name, layout in LAYOUTS.items():
        setup = TrainerSetup.from_config(make_cfg(str(tiny_moe_dir), layout), precision="fp32")
        planned = trainer_memory(shape, TrainerSetup(**{**setup.__dict__, "world_size": 2})).consumers  # 2 ranks
        assert planned["main_weights"] == 0, "FP32 parameters are their own main weights"
        for rank, measured in enumerate(results):
            for key, nbytes in measured[name].items():
                assert abs(planned[key] / nbytes - 1) < 0.10, (name, rank, key, planned[key], nbytes)
