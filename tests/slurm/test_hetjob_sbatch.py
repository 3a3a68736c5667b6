"""slurm/train_hetjob.sbatch: a Slurm heterogeneous job, trainer on component 0, rollout on 1."""
import json

import pytest

from tests.slurm.conftest import submit, wait_no_job_processes

pytestmark = pytest.mark.slurm


@pytest.mark.timeout(300)
def test_hetjob_places_trainer_and_rollout_on_their_components(job_env, probe_config):
    r = submit(job_env, "slurm/train_hetjob.sbatch", [str(probe_config)])
    assert r.rc == 0, r.output
    plan = [line.split(" ") for line in (r.job_dir / "plan.txt").read_text().splitlines()]
    assert [(p[1], p[2], p[3]) for p in plan] == [("node1", "0", "trainer"), ("node2", "1", "rollout")]
    probe = json.loads((r.job_dir / "run" / "probe.json").read_text())
    assert {t["slurmd_nodename"] for t in probe["trainer"]} == {"node1"}
    assert [e["slurmd_nodename"] for e in probe["engine"]] == ["node2"]
    assert wait_no_job_processes(r.job_id) == []


@pytest.mark.timeout(200)
def test_hetjob_rollout_component_with_too_few_gpus_fails_before_ray(job_env, probe_config, fake_gpus):
    # Component 0: 2 GPUs per node, component 1: 1 GPU; the config wants 2 GPUs on rollout nodes.
    r = submit(job_env, "slurm/train_hetjob.sbatch",
               [str(probe_config), "cluster.device=cuda", "train.precision=bf16",
                "cluster.rollout_devices_per_node=2"],
               sbatch_opts=("--gpus-per-node=2", ":", "--gpus-per-node=1"))
    assert r.rc == 2, r.output
    assert "cluster.rollout_devices_per_node=2" in r.output and "node2:1" in r.output, r.output
    assert "starting the Ray head" not in r.output
