"""The export reads checkpoints that Megatron's own ``dist_checkpointing.save`` wrote (the trainer's
format: CRC-checked torch.save blobs, stacked layers, GLU factories) bit-identically.

Reference: the original safetensors (read with the safetensors library).
"""
import os

import pytest
import torch

from megarl.conversion.convert import megatron_to_hf_dir
from megarl.testing.multiproc import run_ranks


def _save_worker(rank, world_size, hf_dir, out_dir):
    import multiprocessing

    from megatron.core import dist_checkpointing

    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.conversion.load_hf import load_hf_weights
    from megarl.training.model import build_model
    from megarl.training.parallel_state import destroy_parallel, initialize_parallel

    parallel = ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                              expert_tensor_parallel_size=1, sequence_parallel=True,
                              use_distributed_optimizer=False)
    ps = initialize_parallel(parallel, backend="gloo")
    chunks = build_model(hf_dir, parallel, ModelConfig(hf_path=hf_dir), precision="fp32", device="cpu", spec="local")
    load_hf_weights(chunks, hf_dir, ps)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    torch.distributed.barrier()
    multiprocessing.current_process().daemon = False  # dist_checkpointing's writers fork processes
    dist_checkpointing.save({"model": chunks[0].sharded_state_dict()}, out_dir)  # as the trainer saves
    destroy_parallel()


@pytest.mark.timeout(300)
def test_export_of_a_megatron_saved_checkpoint_is_bit_identical(tiny_moe_dir, tmp_path):
    from safetensors.torch import load_file

    ckpt = tmp_path / "megatron_saved"
    run_ranks(_save_worker, 2, args=(str(tiny_moe_dir), str(ckpt)), timeout_s=240,
              env={"OMP_NUM_THREADS": "1"})
    out = megatron_to_hf_dir(ckpt, tmp_path / "hf", hf_config_dir=tiny_moe_dir, timeout_s=240)
    ref, got = load_file(tiny_moe_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(got) == sorted(ref)
    for name, tensor in ref.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
