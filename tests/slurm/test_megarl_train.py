"""`sbatch --wait --nodes=2 slurm/train.sbatch configs/<cpu recipe>`: a short real CPU training run
(Megatron trainer ranks on node1, the SGLang engine on node2) returns 0 on the local Slurm.

On the multi-host local Slurm (each node its own network namespace, loopback and address) the
driver and trainer ranks really sit on another host than the engine: every address a component
advertises to another host (Ray nodes, the trainer rendezvous, the engine URL) must be that host's
bridge address, and the established TCP connections sampled on the engine's host show the rollout
HTTP traffic and the weight sync crossing from node1.

Skipped, with the reason, while `megarl train` cannot run yet (:func:`megarl_train_ready`)."""
import ipaddress
import re
import subprocess
import threading
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


class TcpSampler:
    """Established TCP connections of emulated hosts, sampled every 0.5 s with ``ss -tnp`` while
    the job runs (connections between long-lived processes: HTTP keep-alive, process groups).

    ``seen`` holds ``(node, local "ip:port", peer "ip:port", process name)``.
    """

    def __init__(self, netns_by_node: dict[str, str]) -> None:
        self.netns_by_node = netns_by_node
        self.seen: set[tuple[str, str, str, str]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for node, netns in self.netns_by_node.items():
                out = subprocess.run(["nsenter", f"--net=/run/netns/{netns}", "ss", "-Htnp", "state", "established"],
                                     capture_output=True, text=True, timeout=30).stdout
                for line in out.splitlines():
                    fields = line.split()
                    for name in re.findall(r'\("([^"]+)",pid=', line) or ["?"]:
                        self.seen.add((node, fields[2], fields[3], name))

    def __enter__(self) -> "TcpSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def _is_loopback(address: str) -> bool:
    return address == "localhost" or ipaddress.ip_address(address).is_loopback


def _assert_cross_host(r, local_slurm, sampler: TcpSampler) -> None:
    """What node1 and node2 advertised to each other, and what crossed between them."""
    node1, node2 = local_slurm.node_address("node1"), local_slurm.node_address("node2")
    rows = [line.split("\t") for line in (r.job_dir / "nodes.tsv").read_text().splitlines()[1:]]
    assert [(row[1], row[2]) for row in rows] == [("node1", node1), ("node2", node2)]  # Ray node addresses
    log = (r.job_dir / "driver.log").read_text()
    head = re.search(r"connecting to the Ray cluster at (\S+):\d+", log).group(1)
    rendezvous = re.search(r"trainer group: \d+ ranks, rendezvous (\S+):\d+", log).group(1)
    engine_urls = re.findall(r"engine\d+ ready at http://([^:/]+):(\d+)", log)
    assert engine_urls, log[-3000:]
    advertised = [head, rendezvous, *(host for host, _ in engine_urls)]
    assert not [a for a in advertised if _is_loopback(a)], f"loopback advertised across hosts: {advertised}"
    assert (head, rendezvous) == (node1, node1) and {host for host, _ in engine_urls} == {node2}
    # The engine's HTTP port on node2 served clients on node1 (weight-sync coordinator, rollouts) ...
    engine_ports = {f"{node2}:{port}" for _, port in engine_urls}
    http_from_node1 = {c for c in sampler.seen
                       if c[0] == "node2" and c[1] in engine_ports and c[2].startswith(f"{node1}:")}
    assert http_from_node1, sorted(sampler.seen)
    # ... and the engine's own processes (the weight-sync process group) talked to node1.
    engine_to_node1 = {c for c in sampler.seen
                       if c[0] == "node2" and c[3].startswith("sglang") and c[2].startswith(f"{node1}:")}
    assert engine_to_node1, sorted(c for c in sampler.seen if c[0] == "node2")


@pytest.mark.timeout(600)
def test_megarl_train_cpu_recipe_on_two_nodes(job_env, local_slurm, tmp_path):
    recipe, reason = megarl_train_ready()
    if reason:
        pytest.skip(reason)
    env = {k: v for k, v in job_env.items() if k != "MEGARL_DRIVER"}  # the real `megarl train`
    sampler = TcpSampler({node: local_slurm.node_netns(node) for node in ("node1", "node2")}
                         if local_slurm.multihost else {})
    # Short: 2 RL steps, no SFT cold start (so keep zero-reward groups: every step trains), no
    # evaluation; 1 trainer node + 1 rollout node.
    with sampler:
        r = submit(env, "slurm/train.sbatch",
                   [str(recipe.relative_to(ROOT)), "train.num_steps=2", "sft.num_steps=0", "data.eval_interval=0",
                    "algorithm.filter_zero_variance_groups=false",
                    "cluster.device=cpu", "cluster.placement=disaggregated", "cluster.trainer_nodes=1",
                    "cluster.rollout_nodes=1"],
                   sbatch_opts=("--nodes=2",), timeout_s=560)
    print(f"megarl train job {r.job_id}: {r.elapsed_s:.0f}s")
    assert r.rc == 0, r.output[-6000:]
    metrics = (r.job_dir / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) >= 2, metrics
    assert (r.job_dir / "config.yaml").is_file() and (r.job_dir / "driver.log").stat().st_size > 0
    rows = [line.split("\t") for line in (r.job_dir / "nodes.tsv").read_text().splitlines()[1:]]
    assert [(row[1], row[3]) for row in rows] == [("node1", "trainer"), ("node2", "rollout")]
    actors = _actors_by_node(r.job_dir)
    assert "TrainerWorker" in actors["node1"] and "TrainerWorker" not in actors["node2"], actors
    assert "EngineActor" in actors["node2"] and "EngineActor" not in actors["node1"], actors
    if local_slurm.multihost:
        _assert_cross_host(r, local_slurm, sampler)
    assert wait_no_job_processes(r.job_id) == []
