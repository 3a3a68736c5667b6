"""slurm/convert.sbatch with one task per rank on both nodes runs the real
megarl.checkpoint.dist_convert: the TP=2 checkpoint it writes exports back bit-identical
(reference: the original HF safetensors, read with the safetensors library)."""

import pytest
import torch

from megarl.testing.checkpoints import load_safetensors_dir as _load_all
from tests.slurm.conftest import submit, wait_no_job_processes

pytestmark = pytest.mark.slurm


@pytest.mark.timeout(300)
def test_two_tasks_on_two_nodes_convert_tp2_bit_identical(job_env, tiny_moe_dir, tmp_path):
    from megarl.checkpoint.convert import MARKER_FILE, megatron_to_hf_dir

    ckpt = tmp_path / "ckpt"
    r = submit(job_env, "slurm/convert.sbatch",
               ["hf-to-megatron", str(tiny_moe_dir), str(ckpt), "--tensor-model-parallel-size", "2"],
               sbatch_opts=("--nodes=2", "--ntasks-per-node=1"), timeout_s=240)
    assert r.rc == 0, r.output
    assert "rank 0 of 2: wrote" in (r.job_dir / "convert.log").read_text()
    assert (ckpt / MARKER_FILE).exists()
    assert wait_no_job_processes(r.job_id) == []
    ref, out = _load_all(tiny_moe_dir), _load_all(megatron_to_hf_dir(ckpt, tmp_path / "hf", timeout_s=120))
    assert sorted(out) == sorted(ref)
    for name, tensor in ref.items():
        assert torch.equal(out[name], tensor), name
