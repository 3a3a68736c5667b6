"""slurm/engines.sbatch: SGLang engines as their own job; a training job uses them by address."""
import json
import subprocess

import pytest

from tests.slurm.conftest import ROOT, submit, wait_no_job_processes

pytestmark = pytest.mark.slurm

# SGLang on CPU: a small KV cache (the default mem_fraction_static is sized for GPUs).
ENGINE_OVERRIDES = ["rollout.engine.mem_fraction_static=0.05", "rollout.engine.max_total_tokens=4096"]


@pytest.mark.timeout(600)
def test_training_job_uses_engines_of_another_job(job_env, probe_config, tmp_path):
    registry = tmp_path / "registry"
    out = tmp_path / "engines.out"
    engines = subprocess.Popen(
        ["sbatch", "--wait", "--parsable", f"--output={out}", "slurm/engines.sbatch", str(registry),
         str(probe_config), *ENGINE_OVERRIDES], cwd=ROOT, env=job_env, stdout=subprocess.PIPE, text=True)
    engines_job = engines.stdout.readline().strip()
    try:
        env = {**job_env, "MEGARL_EXTERNAL_ENGINES": str(registry), "MEGARL_ENGINES_WAIT_S": "400"}
        r = submit(env, "slurm/train.sbatch", [str(probe_config), *ENGINE_OVERRIDES], sbatch_opts=("--nodes=1",),
                   timeout_s=520)
        assert r.rc == 0, r.output + (out.read_text() if out.exists() else "")
        engines.wait(timeout=60)  # the training job wrote registry/done: the engines job ends by itself
    finally:
        if engines.poll() is None:
            subprocess.run(["scancel", engines_job], env=job_env, timeout=30)
            engines.wait(timeout=60)
    assert engines.returncode == 0, out.read_text()
    urls = (registry / "urls.txt").read_text().split()
    probe = json.loads((r.job_dir / "run" / "probe.json").read_text())
    assert [e["url"] for e in probe["external_engines"]] == urls and len(urls) == 1
    assert len(probe["external_engines"][0]["output_ids"]) == 2  # a real generate on the engine
    assert probe["engine"] == []  # no rollout node in the training job
    assert "rollout.external_engine_urls=[" in r.output
    for job in (engines_job, r.job_id):
        assert wait_no_job_processes(job) == []
