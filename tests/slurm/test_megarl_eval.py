"""`sbatch --wait --nodes=2 slurm/eval.sbatch CONFIG --hf MODEL ...` on the local Slurm (issue 29 §1).

The arithmetic demo's recipe evaluates its (untrained, tiny) model on 4 held-out prompts: Ray across
both emulated nodes, the engine on the rollout node (node2), the driver `megarl eval` on node1; the
job exits 0 and leaves the report in its job directory. That `megarl eval` reproduces a training
run's own evaluation is tests/integration/launch/test_launch_eval.py's; this test is the job around
it. An argument error (no model) fails at once with exit status 2, before any Slurm step.
"""
import json
import shutil
import sys
import tempfile

import pytest

from tests.slurm.conftest import ROOT, make_job_env, submit, wait_no_job_processes

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

RECIPE = "examples/arithmetic_tool/arithmetic_tool.yaml"
JOB_TIMEOUT_S = 500


@pytest.fixture(scope="module")
def model_and_rows(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "examples" / "arithmetic_tool"))
    from make_model import make_model

    root = tmp_path_factory.mktemp("eval_slurm")
    rows = (ROOT / "examples" / "arithmetic_tool" / "data" / "test.jsonl").read_text().splitlines()[:4]
    (root / "eval.jsonl").write_text("\n".join(rows) + "\n")
    return make_model(root / "model").resolve(), root / "eval.jsonl"


@pytest.fixture
def eval_env(local_slurm, tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="mr", dir="/tmp")
    env = make_job_env(local_slurm, tmp_path / "runs", ray_tmp)
    del env["MEGARL_DRIVER"]  # eval.sbatch sets its own (megarl eval ...)
    yield env
    shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_eval_sbatch_evaluates_on_two_nodes(eval_env, model_and_rows):
    model, rows = model_and_rows
    args = [RECIPE, "--hf", str(model), "--samples", "2", "--k", "1,2", f"model.hf_path={model}",
            f"data.eval_path={rows}", "sft.num_steps=0", "rollout.engine.mem_fraction_static=0.5",
            "cluster.device=cpu", "cluster.placement=disaggregated", "cluster.trainer_nodes=1", "cluster.rollout_nodes=1"]
    r = submit(eval_env, "slurm/eval.sbatch", args, sbatch_opts=("--nodes=2",), timeout_s=JOB_TIMEOUT_S)
    print(f"megarl eval job {r.job_id}: {r.elapsed_s:.0f}s")
    assert r.rc == 0, r.output[-6000:]
    report = json.loads((r.job_dir / "report.json").read_text())
    assert report["num_prompts"] == 4 and report["samples_per_prompt"] == 2
    assert report["sampled"]["num_trajectories"] == 8 and set(report["sampled"]["pass@k"]) == {"1", "2"}
    assert report["eval_metrics"]["eval/num_samples"] == 4.0
    assert report["greedy"]["accuracy"] == pytest.approx(report["eval_metrics"]["eval/accuracy"])
    rows_tsv = [line.split("\t") for line in (r.job_dir / "nodes.tsv").read_text().splitlines()[1:]]
    assert [(row[1], row[3]) for row in rows_tsv] == [("node1", "trainer"), ("node2", "rollout")]
    log = (r.job_dir / "driver.log").read_text()
    assert "megarl eval" in log and "pass@2" in log, log[-3000:]
    assert (r.job_dir / "report" / "engine0.log").is_file()
    assert wait_no_job_processes(r.job_id) == []


@pytest.mark.timeout(120)
def test_eval_sbatch_without_a_model_fails_at_once(eval_env):
    r = submit(eval_env, "slurm/eval.sbatch", [RECIPE, "data.eval_path=x"], timeout_s=100)
    assert r.rc == 2, r.output
    assert "give exactly one model" in r.output and "Ray" not in r.output
