"""A stand-in *driver* (not a stand-in component) for slurm/train.sbatch tests: same arguments as
``megarl train`` (CONFIG, overrides, ``cluster.ray_address=...`` last), real Ray.

It places actors the way megarl's driver must (the resource convention of slurm/README.md): one
actor per trainer device with ``{"megarl_trainer": 1}`` and one engine actor with
``{"megarl_rollout": rollout_devices_per_node}`` per rollout node, records which Slurm node each
landed on (``SLURMD_NODENAME`` of its raylet's srun step), then writes ``probe.json`` into
``logging.run_dir``. With ``PROBE_HOLD_S`` set it then writes ``probe.ready`` and sleeps, so a test
can kill a node under a running job.
"""
import json
import os
import socket
import sys
import time
import urllib.request
from pathlib import Path

import ray

from megarl.config import load_config


@ray.remote(num_cpus=0)
class Probe:
    """Reports where it runs."""

    def where(self) -> dict:
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "slurmd_nodename": os.environ.get("SLURMD_NODENAME"), "host": socket.gethostname(),
                "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}


def _generate(url: str) -> dict:
    """Two greedy tokens from an external engine (SGLang's native /generate)."""
    body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    req = urllib.request.Request(f"{url}/generate", data=body.encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        out = json.loads(resp.read())
    return {"url": url, "output_ids": out.get("output_ids"), "finish_reason": out["meta_info"]["finish_reason"]}


def main(argv: list[str]) -> int:
    config, overrides = argv[0], argv[1:]
    address = next(o.split("=", 1)[1] for o in overrides if o.startswith("cluster.ray_address="))
    cfg = load_config(config, overrides)
    cl = cfg.cluster
    ray.init(address=address, log_to_driver=False)
    trainers = [Probe.options(resources={"megarl_trainer": 1}).remote()
                for _ in range(cl.trainer_nodes * cl.trainer_devices_per_node)]
    engines = [Probe.options(resources={"megarl_rollout": cl.rollout_devices_per_node}).remote()
               for _ in range(0 if cfg.rollout.external_engine_urls else cl.rollout_nodes)]
    result = {
        "trainer": ray.get([a.where.remote() for a in trainers], timeout=60),
        "engine": ray.get([a.where.remote() for a in engines], timeout=60),
        "nodes": [{"alive": n["Alive"], "resources": n["Resources"]} for n in ray.nodes()],
        "driver_slurmd_nodename": os.environ.get("SLURMD_NODENAME"),
        "external_engines": [_generate(url) for url in cfg.rollout.external_engine_urls],
    }
    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "probe.json").write_text(json.dumps(result, indent=1))
    print("probe:", json.dumps(result))
    hold_s = float(os.environ.get("PROBE_HOLD_S", "0"))
    if hold_s:
        (run_dir / "probe.ready").write_text("ready")
        time.sleep(hold_s)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
