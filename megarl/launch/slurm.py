"""The Slurm jobs' commands: check a config against the allocation, wait for the Ray nodes, serve engines.

``slurm/train.sbatch`` calls ``check`` before it starts Ray, so a config that asks for more nodes or
GPUs than the job holds fails in seconds, naming the ``cluster.*`` key, instead of after Ray and the
engines have started::

    python -m megarl.launch.slurm check --plan PLAN --resolved CONFIG_OUT CONFIG [key=value ...]
    python -m megarl.launch.slurm wait-nodes --address HEAD:PORT --plan PLAN --timeout-s 300

and ``slurm/engines.sbatch`` runs ``serve-engines`` on each of its nodes (external rollout engines).
The allocation, the checks against it and the node plan are :mod:`megarl.cluster.slurm_env`'s.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from megarl.cluster.slurm_env import Allocation, allocation_issues, missing_nodes, plan_nodes, read_plan

EXIT_INVALID = 2
"""Exit status when the config does not fit the allocation (same as ``megarl validate``)."""
EXIT_RAY_START = 3
"""Exit status when the Ray cluster does not form (a node does not join in time)."""


def cmd_check(args: argparse.Namespace) -> int:
    """Load + validate the config (megarl's validator), check it against the allocation, plan nodes."""
    from megarl.config import ConfigError, to_yaml
    from megarl.launch.preflight import prepare_config

    try:
        alloc = Allocation.from_env()
    except ValueError as e:
        print(f"megarl slurm: bad allocation environment: {e}", file=sys.stderr)
        return EXIT_INVALID
    try:
        cfg = prepare_config(args.config, args.overrides)
        issues = allocation_issues(cfg, alloc)
        if issues:
            raise ConfigError(issues)
    except ConfigError as e:
        print(f"megarl slurm: the config does not fit the allocation ({len(alloc.hosts)} node(s): "
              f"{' '.join(alloc.hosts)}; GPUs per node {list(alloc.gpus)}):\n{e}", file=sys.stderr)
        return EXIT_INVALID
    plans = plan_nodes(cfg, alloc)
    if args.resolved:
        Path(args.resolved).parent.mkdir(parents=True, exist_ok=True)
        Path(args.resolved).write_text(to_yaml(cfg), encoding="utf-8")
    text = "".join(p.line() + "\n" for p in plans)
    if args.plan:
        Path(args.plan).write_text(text, encoding="utf-8")
    sys.stdout.write(text)
    return 0


def cmd_wait_nodes(args: argparse.Namespace) -> int:
    """Connect to the Ray head and wait until every planned node's raylet is alive (bounded)."""
    import ray

    plans = [p for p in read_plan(args.plan) if p.role != "unused" or p.index == 0]
    t0 = time.monotonic()
    ray.init(address=args.address, log_to_driver=False, logging_level=logging.ERROR)
    try:
        while True:
            missing = missing_nodes(ray.nodes(), plans)
            if not missing:
                print(f"megarl slurm: all {len(plans)} Ray nodes joined in {time.monotonic() - t0:.1f}s")
                return 0
            if time.monotonic() - t0 > args.timeout_s:
                names = ", ".join(f"{p.host} (index {p.index}, {p.role})" for p in missing)
                print(f"megarl slurm: node(s) {names} did not join the Ray cluster at {args.address} "
                      f"within {args.timeout_s:.0f}s", file=sys.stderr)
                return EXIT_RAY_START
            time.sleep(0.5)
    finally:
        ray.shutdown()


def cmd_serve_engines(args: argparse.Namespace) -> int:
    """Run CONFIG's engine parts for node ``--node-index`` of ``--num-nodes`` (external engines).

    Which parts, on which GPUs: :func:`megarl.cluster.external_engines.served_engines`
    (``--num-engines`` per node, or one part of an engine spanning nodes; a layout the nodes cannot
    hold exits 2 before anything starts). Each is megarl's own launcher with the settings engines
    started through Ray get, bound to ``--host``. Once healthy, a one-node engine or an engine's
    node-rank 0 writes ``{registry}/{engine_id}.url`` (its URL), another part
    ``{registry}/{engine_id}.joined`` (both atomically). Then it supervises: an engine that exits
    ends this process with status 1, naming it; SIGTERM stops every engine and exits 0.
    """
    import signal

    from megarl.cluster.external_engines import ExternalEnginesError, engine_process, rendezvous, served_engines
    from megarl.config.device import use_cuda
    from megarl.config.schema import as_megarl_config
    from megarl.launch.preflight import prepare_config
    from megarl.weight_sync.choice import engine_custom_weight_loaders, run_transport

    for key in [k for k in os.environ if k.startswith("MEGARL_ALLOC_")]:
        del os.environ[key]  # this job's allocation holds engines only, not the run's trainer nodes
    cfg = as_megarl_config(prepare_config(args.config, args.overrides))
    cuda = use_cuda(cfg.cluster.device)
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d] if cuda else []
    try:
        parts = served_engines(cfg, name=args.name, node_index=args.node_index, num_nodes=args.num_nodes,
                               engines_per_node=args.num_engines, cuda=cuda, visible=visible)
    except ExternalEnginesError as e:
        print(f"megarl engines: {e}", file=sys.stderr)
        return 2
    loaders = engine_custom_weight_loaders(run_transport(cfg, cuda=cuda))  # shard / p2p receive through a loader
    registry = Path(args.registry)
    registry.mkdir(parents=True, exist_ok=True)
    timeout_s = float(cfg.rollout.engine.startup_timeout_s)
    stop = {"requested": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True))
    engines = []
    try:
        for part in parts:
            addr = rendezvous(part, host=args.host, base_port=int(cfg.rollout.engine.base_port),
                              registry=registry, timeout_s=timeout_s)
            engines.append(engine_process(cfg, part, host=args.host, device="cuda" if cuda else "cpu",
                                          registry=registry, custom_weight_loaders=loaders, dist_init_addr=addr))
            engines[-1].start()
        for part, engine in zip(parts, engines):
            engine.wait_healthy(timeout_s)
            kind = "url" if part.node_rank == 0 else "joined"
            tmp = registry / f".{engine.engine_id}.{kind}.tmp"
            tmp.write_text(engine.url + "\n")
            tmp.replace(registry / f"{engine.engine_id}.{kind}")
            print(f"megarl engines: {engine.engine_id} ready at {engine.url}", flush=True)
        return _supervise(engines, args.host, stop)
    finally:
        for engine in engines:
            engine.stop()


def _supervise(engines: list, host: str, stop: dict) -> int:
    """Until SIGTERM (0) or an engine exits (1, naming it)."""
    while not stop["requested"]:
        dead = [e.engine_id for e in engines if not e.is_alive()]
        if dead:
            print(f"megarl engines: {', '.join(dead)} exited on {host}", file=sys.stderr)
            return 1
        time.sleep(1.0)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m megarl.launch.slurm check | wait-nodes | serve-engines``, the sub-commands the
    sbatch scripts run on the allocation; returns the sub-command's exit status.
    """
    parser = argparse.ArgumentParser(prog="python -m megarl.launch.slurm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate CONFIG against the allocation; print the node plan")
    check.add_argument("--plan", help="write the node plan here")
    check.add_argument("--resolved", help="write the resolved config (YAML) here")
    check.add_argument("config")
    check.add_argument("overrides", nargs="*")
    wait = sub.add_parser("wait-nodes", help="wait until every planned node joined the Ray cluster")
    wait.add_argument("--address", required=True)
    wait.add_argument("--plan", required=True)
    wait.add_argument("--timeout-s", type=float, default=300.0)
    serve = sub.add_parser("serve-engines", help="run SGLang engines of CONFIG here for another job")
    serve.add_argument("--host", required=True, help="address to bind, reachable from the trainer")
    serve.add_argument("--registry", required=True, help="directory for the {name}-{k}.url files")
    serve.add_argument("--name", required=True, help="engine name prefix (e.g. the node name)")
    serve.add_argument("--num-engines", type=int, default=1, help="engines per node (MEGARL_ENGINES_PER_NODE)")
    serve.add_argument("--node-index", type=int, default=0, help="this node's index in the engines job")
    serve.add_argument("--num-nodes", type=int, default=1, help="the engines job's node count")
    serve.add_argument("config")
    serve.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    commands = {"check": cmd_check, "wait-nodes": cmd_wait_nodes, "serve-engines": cmd_serve_engines}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
