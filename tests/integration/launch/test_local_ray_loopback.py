"""A single-host run's private Ray instance binds and advertises 127.0.0.1 only, and is its own: a
cluster named by ``RAY_ADDRESS`` (or by the last ``ray start`` on the machine, which Ray 2.60 reads the
same way) is not joined when ``cluster.ray_address`` is empty (before, ``ray.init`` tried to join it
and refused the run's ``num_cpus``; CI met it when a Slurm test's ``ray start`` ran beside it).

Without megarl's switch (`megarl.cluster.placement.loopback_ray`) Ray 2.60 takes the machine's
interface address for its node (GCS, raylet and workers listen on it, some on 0.0.0.0) and every
rendezvous megarl takes from Ray's node address (trainer group, weight sync) advertises it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = r"""
import json, os, psutil, ray
from megarl.config import load_config
from megarl.cluster.placement import init_ray

assert init_ray(load_config("configs/cpu_gsm8k.yaml", []), cuda=False)

@ray.remote
def worker_ip():
    return ray.util.get_node_ip_address()

listening = set()
for proc in psutil.Process(os.getpid()).children(recursive=True):
    try:
        listening |= {c.laddr.ip for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    except psutil.Error:
        pass
print(json.dumps({"driver": ray.util.get_node_ip_address(), "worker": ray.get(worker_ip.remote()),
                  "nodes": [n["NodeManagerAddress"] for n in ray.nodes()], "listening": sorted(listening),
                  "switch_left_in_env": "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" in os.environ}))
ray.shutdown()
"""


@pytest.mark.timeout(180)
def test_local_ray_instance_lives_on_loopback():
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:9"}  # a cluster the run must not join (nothing listens)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=170,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["driver"] == seen["worker"] == "127.0.0.1" and seen["nodes"] == ["127.0.0.1"], seen
    assert seen["listening"] and set(seen["listening"]) <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, seen
    # a Slurm job or `ray start` this process starts later must not inherit the single-host switch
    assert not seen["switch_left_in_env"], seen
