"""`sbatch --wait --nodes=2 slurm/train.sbatch configs/<cpu recipe>`: a short real CPU training run
(Megatron trainer ranks on node1, the SGLang engine on node2) returns 0 on the local Slurm.

Skipped, with the reason, while `megarl train` cannot run yet (:func:`megarl_train_ready`)."""
import re
from pathlib import Path

import pytest

from tests.slurm.conftest import ROOT, megarl_train_ready, submit, wait_no_job_processes

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _actors_by_node(job_dir: Path) -> dict[str, set[str]]:
    """Actor class names found in each node's Ray worker logs (``:actor_name:`` lines)."""
    out = {}
    for row in (job_dir / "nodes.tsv").read_text().splitlines()[1:]:
        fields = row.split("\t")
        logs = Path(fields[4].split(":", 1)[1])
        names = set()
        for f in logs.glob("worker-*.out"):
            names |= set(re.findall(r"^:actor_name:(\w+)", f.read_text(errors="replace"), re.M))
        out[fields[1]] = names
    return out


@pytest.mark.timeout(600)
def test_megarl_train_cpu_recipe_on_two_nodes(job_env, tmp_path):
    recipe, reason = megarl_train_ready()
    if reason:
        pytest.skip(reason)
    env = {k: v for k, v in job_env.items() if k != "MEGARL_DRIVER"}  # the real `megarl train`
    # Short: 2 RL steps, no SFT cold start (so keep zero-reward groups: every step trains), no
    # evaluation; 1 trainer node + 1 rollout node.
    r = submit(env, "slurm/train.sbatch",
               [str(recipe.relative_to(ROOT)), "train.num_steps=2", "sft.num_steps=0", "data.eval_interval=0",
                "algorithm.filter_zero_variance_groups=false",
                "cluster.device=cpu", "cluster.placement=disaggregated", "cluster.trainer_nodes=1",
                "cluster.rollout_nodes=1"],
               sbatch_opts=("--nodes=2",), timeout_s=560)
    assert r.rc == 0, r.output[-6000:]
    metrics = (r.job_dir / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) >= 2, metrics
    assert (r.job_dir / "config.yaml").is_file() and (r.job_dir / "driver.log").stat().st_size > 0
    rows = [line.split("\t") for line in (r.job_dir / "nodes.tsv").read_text().splitlines()[1:]]
    assert [(row[1], row[3]) for row in rows] == [("node1", "trainer"), ("node2", "rollout")]
    actors = _actors_by_node(r.job_dir)
    assert "TrainerWorker" in actors["node1"] and "TrainerWorker" not in actors["node2"], actors
    assert "EngineActor" in actors["node2"] and "EngineActor" not in actors["node1"], actors
    assert wait_no_job_processes(r.job_id) == []
