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
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from megarl.cluster.slurm_env import Allocation, allocation_issues, missing_nodes, plan_nodes, read_plan

EXIT_INVALID = 2
"""Exit status when the config does not fit the allocation (same as ``megarl validate``)."""
EXIT_RAY_START = 3
"""Exit status when the Ray cluster does not form (a node does not join in time)."""


def cmd_check(args: argparse.Namespace) -> int:
    """Load + validate the config (megarl's validator), check it against the allocation, plan nodes."""
    from megarl.launch.preflight import prepare_config
    from megarl.config import ConfigError, to_yaml

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
    ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
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
    """Run ``--num-engines`` SGLang engines of CONFIG on this node for another job (external engines).

    Each engine is megarl's own launcher (:class:`megarl.rollout.engine.EngineProcess`, the settings
    :func:`megarl.cluster.engines.engine_kwargs` derives from the config, CPU shims on CPU) bound to
    ``--host``. Once healthy, ``{registry}/{name}-{k}.url`` holds its URL (written atomically).
    Then it supervises: an engine that exits ends this process with status 1, naming it; SIGTERM
    stops every engine and exits 0.
    """
    import signal

    from megarl.launch.preflight import prepare_config
    from megarl.config.device import use_cuda
    from megarl.cluster.engines import engine_kwargs
    from megarl.rollout.engine import EngineProcess, find_free_port

    for key in [k for k in os.environ if k.startswith("MEGARL_ALLOC_")]:
        del os.environ[key]  # this job's allocation holds engines only, not the run's trainer nodes
    cfg = prepare_config(args.config, args.overrides)
    cuda = use_cuda(cfg.cluster.device)
    from megarl.weight_sync.choice import engine_custom_weight_loaders, run_transport

    loaders = engine_custom_weight_loaders(run_transport(cfg))  # shard / p2p receive through a loader
    registry = Path(args.registry)
    registry.mkdir(parents=True, exist_ok=True)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if cuda else []
    per_engine = len(visible) // args.num_engines if visible else 0
    engines = []
    for k in range(args.num_engines):
        name = f"{args.name}-{k}"
        env = {"CUDA_VISIBLE_DEVICES": ",".join(visible[k * per_engine:(k + 1) * per_engine])} if per_engine else {}
        kwargs = engine_kwargs(cfg, device="cuda" if cuda else "cpu", log_path=str(registry / f"{name}.log"),
                               engine_id=name, custom_weight_loaders=loaders, env=env)
        kwargs["host"] = args.host
        port = find_free_port(args.host, cfg.rollout.engine.base_port + 10 * k)
        engines.append(EngineProcess(cfg.model.hf_path, port=port, **kwargs))
    stop = {"requested": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True))
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_healthy(cfg.rollout.engine.startup_timeout_s)
            tmp = registry / f".{engine.engine_id}.url.tmp"
            tmp.write_text(engine.url + "\n")
            tmp.replace(registry / f"{engine.engine_id}.url")
            print(f"megarl engines: {engine.engine_id} ready at {engine.url}", flush=True)
        while not stop["requested"]:
            dead = [e.engine_id for e in engines if not e.is_alive()]
            if dead:
                print(f"megarl engines: {', '.join(dead)} exited on {args.host}", file=sys.stderr)
                return 1
            time.sleep(1.0)
        return 0
    finally:
        for engine in engines:
            engine.stop()


def main(argv: Optional[Sequence[str]] = None) -> int:
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
    serve.add_argument("--num-engines", type=int, default=1)
    serve.add_argument("config")
    serve.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    commands = {"check": cmd_check, "wait-nodes": cmd_wait_nodes, "serve-engines": cmd_serve_engines}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
