"""megarl.checkpoint.dist_convert: one process per rank, launched from outside (torchrun-style env).

References: the original HF safetensors (read with the safetensors library) after a round trip
through the single-process exporter, and the rendezvous variables written in the tests.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.checkpoint.convert import MARKER_FILE, megatron_to_hf_dir
from megarl.checkpoint.dist_convert import Rendezvous, rendezvous_from_env
from megarl.testing.checkpoints import load_safetensors_dir as _load_all
from megarl.testing.multiproc import free_port

ROOT = Path(__file__).resolve().parents[3]


def _env(**extra):
    rendezvous = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in rendezvous}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}", **extra)
    return env


def _launch(world_size, args, log_dir, timeout_s=240, direction="hf-to-megatron"):
    """Start ``world_size`` ranks of dist_convert; returns [(returncode, output)] by rank."""
    port = str(free_port())
    cmd = [sys.executable, "-m", "megarl.checkpoint.dist_convert", direction, *map(str, args)]
    procs, logs = [], []
    try:
        for rank in range(world_size):
            env = _env(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            logs.append(open(log_dir / f"rank{rank}.log", "w+"))
            procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=logs[-1], stderr=subprocess.STDOUT))
        results = []
        for proc, log in zip(procs, logs):
            rc = proc.wait(timeout=timeout_s)
            log.seek(0)
            results.append((rc, log.read()))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        for log in logs:
            log.close()


@pytest.mark.timeout(420)
def test_two_launched_ranks_write_a_tp2_checkpoint_that_exports_bit_identical(tiny_moe_dir, tmp_path,
                                                                              tmp_path_factory):
    ckpt = tmp_path / "ckpt_tp2"
    logs = tmp_path_factory.mktemp("dist_convert_logs")
    results = _launch(2, [tiny_moe_dir, ckpt, "--tensor-model-parallel-size", "2"], logs)
    for rank, (rc, output) in enumerate(results):
        assert rc == 0, f"rank {rank}:\n{output}"
    assert "wrote" in results[0][1]
    assert (ckpt / MARKER_FILE).exists() and (ckpt / "hf_config" / "config.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directory left"
    # Both ranks wrote shards (torch_dist: one __<rank>_<n>.distcp file set per rank).
    assert {p.name.split("_")[2] for p in ckpt.glob("__*.distcp")} == {"0", "1"}

    exported = megatron_to_hf_dir(ckpt, tmp_path / "hf", timeout_s=240)
    ref, out = _load_all(tiny_moe_dir), _load_all(exported)
    assert sorted(out) == sorted(ref)
    for name, tensor in ref.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name


@pytest.mark.timeout(120)
def test_world_size_other_than_the_layout_is_refused_naming_flag_and_variable(tiny_moe_dir, tmp_path,
                                                                              tmp_path_factory):
    logs = tmp_path_factory.mktemp("dist_convert_logs")
    [(rc, output)] = _launch(1, [tiny_moe_dir, tmp_path / "ckpt", "--tensor-model-parallel-size", "2"], logs,
                             timeout_s=100)
    assert rc == 2, output
    assert "WORLD_SIZE=1" in output and "--tensor-model-parallel-size 2" in output and "2 ranks" in output
    assert not (tmp_path / "ckpt").exists() and list(tmp_path.iterdir()) == []


@pytest.mark.slow  # ~40 s on 2 shared cores: an import and two exports
@pytest.mark.timeout(420)
def test_two_launched_ranks_export_the_single_process_tensors(tiny_moe_dir, tmp_path, tmp_path_factory):
    """megatron-to-hf at 2 launched ranks (issue 35 item 3): each writes its own shards, rank 0 the
    one index; the tensors are the single-process export's (and the original's), byte for byte."""
    from megarl.checkpoint.convert import hf_to_megatron
    from megarl.checkpoint.hf_io import INDEX_FILE

    ckpt = hf_to_megatron(tiny_moe_dir, tmp_path / "ckpt", timeout_s=240)
    logs = tmp_path_factory.mktemp("dist_export_logs")
    results = _launch(2, [ckpt, tmp_path / "hf", "--max-shard-size-gb", "0.0001"], logs,
                      direction="megatron-to-hf")
    for rank, (rc, output) in enumerate(results):
        assert rc == 0, f"rank {rank}:\n{output}"
    assert "wrote" in results[0][1]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directory left"
    single = megatron_to_hf_dir(ckpt, tmp_path / "hf_single", max_shard_bytes=int(0.0001 * 2**30), timeout_s=240)
    ref, out = _load_all(single), _load_all(tmp_path / "hf")
    assert sorted(out) == sorted(ref) == sorted(_load_all(tiny_moe_dir))
    for name, tensor in ref.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name
    weight_map = json.loads((tmp_path / "hf" / INDEX_FILE).read_text())["weight_map"]
    assert sorted(weight_map) == sorted(out)
    assert sorted(set(weight_map.values())) == sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert (tmp_path / "hf" / "config.json").read_bytes() == (single / "config.json").read_bytes()


def test_rendezvous_from_slurm_variables():
    hosts = {}

    def first_host(nodelist):
        hosts["asked"] = nodelist
        return "node7"

    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "123456",
           "SLURM_JOB_NODELIST": "node[7-10]"}
    assert rendezvous_from_env(env, first_host=first_host) == Rendezvous(
        5, 8, 1, "node7", 20000 + 123456 % 20000, "SLURM_PROCID")
    assert hosts["asked"] == "node[7-10]"
    env.update(MASTER_ADDR="10.0.0.1", MASTER_PORT="4242")
    assert rendezvous_from_env(env, first_host=first_host) == Rendezvous(5, 8, 1, "10.0.0.1", 4242, "SLURM_PROCID")
    # torchrun's variables win over Slurm's (slurm/lib/dist_rank.sh sets them from Slurm's).
    env.update(RANK="3", WORLD_SIZE="4", LOCAL_RANK="0")
    assert rendezvous_from_env(env, first_host=first_host) == Rendezvous(3, 4, 0, "10.0.0.1", 4242, "RANK")
    with pytest.raises(ValueError, match="MASTER_PORT"):
        rendezvous_from_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})
