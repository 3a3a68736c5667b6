"""slurm/convert.sbatch: the multi-node torch.distributed rendezvous (one task per rank across both
nodes), fail-fast when one rank fails, and the one-task path (`megarl convert`) with its status."""
import json

import pytest

from tests.slurm.conftest import ROOT, submit, wait_no_job_processes

pytestmark = pytest.mark.slurm


@pytest.mark.timeout(200)
def test_ranks_on_both_nodes_join_one_process_group(job_env, local_slurm, tmp_path):
    out = tmp_path / "dist.json"
    env = {**job_env, "MEGARL_CONVERT_CMD": f"python {ROOT}/tests/slurm/dist_probe.py {out}"}
    r = submit(env, "slurm/convert.sbatch", ["hf-to-megatron", "SRC", "DST"],
               sbatch_opts=("--nodes=2", "--ntasks-per-node=2"))
    assert r.rc == 0, r.output
    got = json.loads(out.read_text())
    assert got["sum"] == 0 + 1 + 2 + 3 and got["args"] == ["hf-to-megatron", "SRC", "DST"]
    ranks = got["ranks"]
    assert [int(x["RANK"]) for x in ranks] == [0, 1, 2, 3]
    assert [(x["SLURMD_NODENAME"], x["NODE_RANK"], x["LOCAL_RANK"]) for x in ranks] == [
        ("node1", "0", "0"), ("node1", "0", "1"), ("node2", "1", "0"), ("node2", "1", "1")]
    assert {x["WORLD_SIZE"] for x in ranks} == {"4"} and {x["LOCAL_WORLD_SIZE"] for x in ranks} == {"2"}
    assert {x["GLOO_SOCKET_IFNAME"] for x in ranks} == {"eth0" if local_slurm.multihost else "lo"}


@pytest.mark.timeout(200)
def test_a_failing_rank_ends_the_job_instead_of_hanging(job_env, tmp_path):
    env = {**job_env, "MEGARL_CONVERT_CMD": f"python {ROOT}/tests/slurm/dist_probe.py {tmp_path / 'x.json'}",
           "FAIL_RANK": "1"}
    r = submit(env, "slurm/convert.sbatch", ["hf-to-megatron", "SRC", "DST"],
               sbatch_opts=("--nodes=2", "--ntasks-per-node=1"), timeout_s=150)
    assert r.rc != 0, r.output
    assert not (tmp_path / "x.json").exists()
    assert wait_no_job_processes(r.job_id) == []


@pytest.mark.timeout(200)
def test_one_task_runs_megarl_convert_and_returns_its_status(job_env, tmp_path):
    # The real `megarl convert` on one task; a folder that is no checkpoint is refused (exit 2, the
    # CLI's status for every expected error) and the job returns that status.
    (tmp_path / "ckpt").mkdir()
    r = submit(job_env, "slurm/convert.sbatch", ["megatron-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")])
    assert r.rc == 2, r.output
    assert "is not a Megatron dist checkpoint" in (r.job_dir / "convert.log").read_text()  # named, then rc 2
    assert not (tmp_path / "hf").exists()


@pytest.mark.timeout(200)
def test_one_task_in_a_container_reaches_srun(job_env, tmp_path):
    """Issue 18 item 12: with MEGARL_CONTAINER_IMAGE the one-task path runs `megarl convert` in the
    container on the batch node (``srun --nodelist=HOSTS[0] --container-image=...``); it stopped
    on an unbound HOSTS before. The local Slurm has no pyxis, so srun then refuses the option."""
    env = {**job_env, "MEGARL_CONTAINER_IMAGE": "megarl-test-image"}
    r = submit(env, "slurm/convert.sbatch", ["megatron-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")])
    log = r.output + (r.job_dir / "convert.log").read_text() if (r.job_dir / "convert.log").exists() else r.output
    assert "unbound variable" not in log, log
    assert r.rc != 0 and "container-image" in log, log
