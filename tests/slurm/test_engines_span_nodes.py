"""External engines span Slurm nodes (issue 35 item 4), on the local two-node Slurm.

``slurm/engines.sbatch --nodes=2`` with an engine of TP 2 and ``cluster.rollout_devices_per_node=1``
runs one SGLang engine across both nodes (``serve-engines``: ``--nnodes 2 --node-rank r
--dist-init-addr`` node1's address, as engines started through Ray). Each emulated node is its own
host: its own network namespace and address (:mod:`megarl.testing.netns`) and, since a shared
``/dev/shm`` makes SGLang take two nodes for one (``parallel_state.in_the_same_node_as`` opens a
shared-memory segment), its own ``/dev/shm`` (``tools/local_slurm/start.sh``: each slurmd in a
private mount namespace); the first test checks that with plain job steps.

References: node-rank 0 binds node1's address and serves the API, node-rank 1 binds node2's and
answers ``/health`` only (SGLang's dummy server); a greedy generate's logprobs equal a Hugging Face
forward pass of the same weights on the same tokens (float32, TP 2 reduction order: 1e-3).
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from megarl.testing.netns import Host
from tests.integration.rollout.test_engine_nodes_emulated import NEW_TOKENS, PROMPT, _hf_logprobs, _http
from tests.slurm.conftest import ROOT, submit, wait_no_job_processes

pytestmark = pytest.mark.slurm

SPAN_TIMEOUT_S = 1500
"""The engine's two parts healthy (and the job's bound). On the 2-core machine at load ~6 both parts
were healthy after 144 s and the test took 151 s (+23 s building the tiny model and the cluster)."""

SHM_SCRIPT = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
set -euo pipefail
tag=mrshm-$SLURM_JOB_ID
one_per_node=(--overlap --nodes=2 --ntasks=2 --ntasks-per-node=1)
srun "${one_per_node[@]}" bash -c "echo x > /dev/shm/$tag-\\$SLURMD_NODENAME"
srun "${one_per_node[@]}" bash -c "echo SEEN \\$SLURMD_NODENAME \\$(cd /dev/shm && echo $tag-*)"
srun "${one_per_node[@]}" bash -c "rm -f /dev/shm/$tag-*"
"""


def _node_host(local_slurm, node: str) -> Host:
    return Host(name=node, netns=local_slurm.node_netns(node), addr=local_slurm.node_address(node))


@pytest.mark.timeout(180)
def test_each_node_has_its_own_dev_shm(local_slurm, job_env, tmp_path):
    if not local_slurm.multihost:
        pytest.skip("the local Slurm in use puts every node in one namespace (LOCAL_SLURM_MULTIHOST=0)")
    script = tmp_path / "shm.sbatch"
    script.write_text(SHM_SCRIPT)
    r = submit(job_env, str(script), [], timeout_s=150)
    assert r.rc == 0, r.output
    seen = {line.split()[1]: line.split()[2:] for line in r.output.splitlines() if line.startswith("SEEN ")}
    tag = f"mrshm-{r.job_id}"
    # Each node sees the file it wrote and not the other's; the machine's /dev/shm sees neither.
    assert seen == {"node1": [f"{tag}-node1"], "node2": [f"{tag}-node2"]}, r.output
    assert not list(Path("/dev/shm").glob(f"{tag}-*"))


def _span_config(tmp_path: Path, model_dir) -> Path:
    """A CPU config whose one engine (TP 2) spans two nodes of one device each."""
    (tmp_path / "train.jsonl").write_text('{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\\n#### 5"}\n' * 3)
    cfg = tmp_path / "span.yaml"
    cfg.write_text(f"""extends: {ROOT}/configs/base.yaml
model: {{hf_path: {model_dir}}}
data: {{train_path: {tmp_path}/train.jsonl, eval_path: null}}
train: {{precision: fp32, global_batch_size: 8}}
rollout:
  num_prompts_per_step: 2
  group_size: 4
  engine: {{tensor_parallel_size: 2, dtype: float32, mem_fraction_static: 0.1, max_total_tokens: 2048,
           grammar_backend: none, startup_timeout_s: {SPAN_TIMEOUT_S - 120}}}
cluster: {{device: cpu, trainer_nodes: 1, trainer_devices_per_node: 1, rollout_nodes: 2,
          rollout_devices_per_node: 1}}
""")
    return cfg


def _wait_for_urls(registry: Path, engines: subprocess.Popen, out: Path) -> list[str]:
    deadline = time.monotonic() + SPAN_TIMEOUT_S
    while not (registry / "urls.txt").exists():
        assert engines.poll() is None, f"the engines job ended (status {engines.returncode}):\n" + _logs(registry, out)
        assert time.monotonic() < deadline, f"no urls.txt within {SPAN_TIMEOUT_S} s:\n" + _logs(registry, out)
        time.sleep(2)
    return (registry / "urls.txt").read_text().split()


def _logs(registry: Path, out: Path) -> str:
    files = [out, *sorted(registry.glob("*.log"))]
    return "\n".join(f"===== {f.name}\n{f.read_text(errors='replace')[-4000:]}" for f in files if f.exists())


@pytest.mark.slow
@pytest.mark.timeout(SPAN_TIMEOUT_S + 300)
def test_one_engine_spans_both_slurm_nodes(local_slurm, job_env, tiny_dense_dir, tmp_path):
    if not local_slurm.multihost:
        pytest.skip("the local Slurm in use puts every node in one namespace (LOCAL_SLURM_MULTIHOST=0)")
    node1, node2 = _node_host(local_slurm, "node1"), _node_host(local_slurm, "node2")
    registry, out = tmp_path / "registry", tmp_path / "engines.out"
    t0 = time.monotonic()
    engines = subprocess.Popen(
        ["sbatch", "--wait", "--parsable", "--nodes=2", f"--output={out}", "slurm/engines.sbatch", str(registry),
         str(_span_config(tmp_path, tiny_dense_dir))], cwd=ROOT, env=job_env, stdout=subprocess.PIPE, text=True)
    job = engines.stdout.readline().strip()
    try:
        urls = _wait_for_urls(registry, engines, out)
        healthy_s = time.monotonic() - t0
        # One engine: node-rank 0 on node1 (its URL, its rendezvous), node-rank 1 on node2.
        assert len(urls) == 1 and urlparse(urls[0]).hostname == node1.addr, urls
        assert sorted(p.name for p in registry.iterdir() if p.suffix in (".url", ".joined", ".rdzv")) == \
            ["engine0.node1.joined", "engine0.rdzv", "engine0.url"]
        assert (registry / "engine0.rdzv").read_text().startswith(f"{node1.addr}:")
        rank1 = (registry / "engine0.node1.joined").read_text().strip()
        assert urlparse(rank1).hostname == node2.addr, rank1
        gen = _http(node2, f"{urls[0]}/generate", {
            "input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
        assert gen["status"] == 200, gen
        lps = json.loads(gen["body"])["meta_info"]["output_token_logprobs"]
        ids = [t for _, t, _ in lps]
        assert len(ids) == NEW_TOKENS
        assert [lp for lp, _, _ in lps] == pytest.approx(_hf_logprobs(tiny_dense_dir, PROMPT + ids), abs=1e-3)
        assert _http(node1, f"{rank1}/health")["status"] == 200  # node-rank 1: schedulers, no API
        assert _http(node1, f"{rank1}/generate", {"input_ids": PROMPT})["status"] in (404, 405)
        (registry / "done").write_text("test\n")  # the engines job stops its engines and exits 0
        engines.wait(timeout=90)
    except BaseException:
        print(_logs(registry, out))
        raise
    finally:
        if engines.poll() is None:
            subprocess.run(["scancel", job], env=job_env, timeout=30)
            engines.wait(timeout=60)
    assert engines.returncode == 0, _logs(registry, out)
    assert wait_no_job_processes(job) == []
    print(f"engine healthy on both nodes after {healthy_s:.0f} s; job done after {time.monotonic() - t0:.0f} s")
