"""The Python side of ``tools/gpu_check.sh``: checks for a bare single-GPU node (or, ``--device cpu``,
the same steps on a CPU machine over gloo with a tiny model, to prove the script's logic).

Each subcommand runs one check in this process as a world-size-1 job (``torch.distributed`` from
the environment: NCCL on CUDA, gloo on CPU), prints what it measured and one line
``RESULT {json}``, and exits 0 only if every assertion held::

    python -m megarl.testing.gpu_check env --device cuda
    python -m megarl.testing.gpu_check replay --device cuda --precision bf16
    python -m megarl.testing.gpu_check throughput --device cuda --size 1b --steps 3

- ``env``: versions (torch, CUDA, NCCL, Megatron-Core, transformers, Transformer Engine if any),
  the device, and that CUDA and NCCL are there when ``--device cuda``.
- ``replay``: megarl's real trainer (`megarl.training.trainer_build.build_trainer`; without Transformer
  Engine the local layer spec) on a tiny Qwen3-MoE with HF weights. R2: ``prepare_batch`` records
  every token's top-k in the old-logprob pass (valid ids, no repeats, equal to a free forward's
  logprobs). R3: those routes given as the engine's replay the free forward's logprobs (the
  reference), shifted routes change them (replay acts), a batch without routes is refused. Then
  one GSPO step under R3 and one under R2: first sequence ratios 1 (old and new policy equal),
  finite loss, a gradient.
- ``throughput``: trainer tokens/s and MFU (`megarl.launch.mfu`, the device's bf16 peak) of a
  Qwen3-MoE-shaped model at random init (``--size 1b``: ~1.0B parameters, 64 experts, top-8;
  ``small``: the tiny model's shape, for CPU).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SIZES: dict[str, dict[str, Any]] = {
    # Qwen3-30B-A3B's shape (head_dim 128, 4 KV heads, top-8 of many experts, vocab 151936), scaled to
    # ~1.0B parameters (~0.3B active per token); ``small`` is the tiny test model's shape.
    "1b": dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
               intermediate_size=3072, moe_intermediate_size=256, num_experts=64, num_experts_per_tok=8,
               vocab_size=151936),
    "small": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                  vocab_size=2048),
}
"""Qwen3-MoE shapes for ``throughput --size``."""

TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}
"""Largest |logprob difference| (nats) allowed between a free forward and the replay of its own
routes, per precision (bf16: CUDA kernels such as expert index_add may add in another order)."""


class CheckFailed(AssertionError):
    """A check's assertion did not hold (the message names what and the numbers)."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


def _start_single_rank(device: str) -> None:
    """Environment for ``torch.distributed``'s ``env://`` rendezvous of a world of one rank."""
    from megarl.procs.local_ranks import free_port

    if device == "cuda" and not torch.cuda.is_available():
        raise CheckFailed("--device cuda but torch.cuda.is_available() is False")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def _config(hf_dir: str | Path, device: str, precision: str, **train):
    from megarl.config.schema import MegarlConfig

    cfg = MegarlConfig()
    cfg.model.hf_path, cfg.cluster.device, cfg.train.precision = str(hf_dir), device, precision
    cfg.train.num_steps = 10
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def random_batch(vocab_size: int, lengths: list[int], *, prompt_tokens: int, seed: int = 0):
    """A `TrainBatch` of random token ids: sequences of the given lengths, the first
    ``prompt_tokens`` of each untrained (``loss_mask`` 0), advantages ~ N(0, 1), engine logprobs 0.

    Args:
        vocab_size: ids are drawn from ``[0, vocab_size)``.
        lengths: ``[B]`` tokens per sequence (each > ``prompt_tokens``).
    """
    from megarl.training.batch import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    total = int(cu[-1])
    mask = torch.ones(total, dtype=torch.bool)
    for start in cu[:-1].tolist():
        mask[start:start + prompt_tokens] = False
    return TrainBatch(input_ids=torch.randint(0, vocab_size, (total,), generator=gen), cu_seqlens=cu,
                      loss_mask=mask, advantages=torch.randn(len(lengths), generator=gen),
                      rollout_logprobs=torch.zeros(total))


def check_env(device: str) -> dict:
    """Versions and the device; CUDA, NCCL and a GPU name when ``device == "cuda"``."""
    if device == "cuda":  # before the slow imports: a node without a usable GPU fails in seconds
        _require(torch.cuda.is_available(), "CUDA is not available to torch")
        _require(torch.distributed.is_nccl_available(), "torch.distributed has no NCCL")
    import megatron.core
    import transformers

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "megatron_core": megatron.core.__version__, "transformers": transformers.__version__,
           "cuda_available": torch.cuda.is_available()}
    try:
        import transformer_engine
        out["transformer_engine"] = transformer_engine.__version__
    except Exception as err:  # noqa: BLE001 - absent or broken: the local layer spec is used
        out["transformer_engine"] = f"absent ({type(err).__name__})"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        out.update(device_name=props.name, device_memory_gib=round(props.total_memory / 2**30, 1),
                   nccl=".".join(map(str, torch.cuda.nccl.version())), num_devices=torch.cuda.device_count())
    return out


def _diffs(a, b, mask) -> tuple[float, float]:
    """``(max, mean)`` of ``|a - b|`` over the trained tokens (``mask`` True)."""
    diff = (a - b)[mask].abs()
    return float(diff.max()), float(diff.mean())


def check_replay(device: str, precision: str, workdir: str) -> dict:
    """R2 and R3 routing replay through the real trainer (module docstring).

    Raises:
        CheckFailed: a route, logprob or step metric is off (names which, with the numbers).
        megarl.training.routing_replay.RoutingReplayError: replay refused valid routes.
    """
    from megarl.conversion.initial_weights import initial_weights
    from megarl.models.tiny import TinyModelSpec, make_tiny_model
    from megarl.training.parallel_state import destroy_parallel
    from megarl.training.trainer_build import build_trainer

    _start_single_rank(device)
    hf_dir = make_tiny_model(Path(workdir) / "tiny_moe", TinyModelSpec(family="qwen3_moe"))
    cfg = _config(hf_dir, device, precision, routing_replay="r2", lr=1e-5, max_tokens_per_microbatch=256)
    trainer = build_trainer(cfg, load_weights=initial_weights(cfg.model))
    num_experts, topk = trainer.config.num_moe_experts, trainer.config.moe_router_topk
    batch = random_batch(trainer.vocab_size, [40, 64, 96, 128, 50, 77, 110, 33], prompt_tokens=8, seed=3)
    mask, tol = batch.loss_mask, TOLERANCE[precision]
    out: dict[str, Any] = {"spec": "te" if trainer._te_attention else "local", "device": str(trainer.device),
           "precision": precision, "num_tokens": batch.num_tokens, "tolerance": tol}
    _require(trainer.device.type == device, f"trainer built on {trainer.device}, expected {device}")

    free = trainer.compute_logprobs(batch)  # no routes given: every router chooses freely
    prepared = trainer.prepare_batch(batch)  # R2: old logprobs and routes from one free forward
    routes = prepared.routed_experts
    _require(routes is not None and tuple(routes.shape) == (batch.num_tokens, trainer.num_layers, topk),
             f"R2 routes shape {None if routes is None else tuple(routes.shape)}")
    _require(bool(((routes >= 0) & (routes < num_experts)).all()), "R2 recorded an expert id outside [0, E)")
    _require(bool((routes.sort(-1).values.diff(dim=-1) != 0).all()), "R2 recorded an expert twice for a token")
    # two free forwards of the same weights: their difference is the kernels' run-to-run noise
    out["r2_old_vs_free"], noise_mean = _diffs(prepared.old_logprobs, free, mask)
    _require(out["r2_old_vs_free"] <= tol,
             f"R2 old logprobs differ from a free forward by {out['r2_old_vs_free']}")

    out.update(_check_r3(trainer, batch, routes, free, tol=tol, noise_mean=noise_mean))
    out["r3_step"] = _step_metrics(trainer.train_step(batch.replace(routed_experts=routes)))
    trainer.cfg.train.routing_replay = "r2"
    out["r2_step"] = _step_metrics(trainer.train_step(batch))  # records anew on the stepped weights
    for name in ("r3_step", "r2_step"):
        m = out[name]
        _require(all(math.isfinite(m[k]) for k in m), f"{name}: non-finite metric {m}")
        _require(abs(m["ratio_min"] - 1) <= tol and abs(m["ratio_max"] - 1) <= tol,
                 f"{name}: first GSPO sequence ratios {m['ratio_min']}..{m['ratio_max']}, expected 1")
        _require(m["grad_norm"] > 0 and m["update_successful"] == 1, f"{name}: no gradient step {m}")
    del trainer
    destroy_parallel(destroy_process_group=True)
    return out


def _check_r3(trainer, batch, routes, free, *, tol: float, noise_mean: float) -> dict:
    """R3 on ``trainer`` (left in ``r3`` mode): replaying the free forward's own ``routes``
    ``[T, L, K]`` reproduces its logprobs ``free`` ``[T]``; shifted routes change them; no routes
    are refused."""
    from megarl.training.routing_replay import RoutingReplayError

    out: dict[str, Any] = {}
    mask, num_experts = batch.loss_mask, trainer.config.num_moe_experts
    trainer.cfg.train.routing_replay = "r3"  # the same trainer: the mode is read at every call
    replayed = trainer.compute_logprobs(batch.replace(routed_experts=routes))
    shifted = trainer.compute_logprobs(batch.replace(routed_experts=(routes + 1) % num_experts))
    out["r3_replay_vs_free"], replay_mean = _diffs(replayed, free, mask)
    out["r3_shifted_vs_free"], out["r3_shifted_vs_free_mean"] = _diffs(shifted, free, mask)
    _require(out["r3_replay_vs_free"] <= tol,
             f"R3 replay of the free routes moved logprobs by {out['r3_replay_vs_free']}")
    # means, not maxima: under bf16 a single token's noise can be large, the mean of real changes is not
    _require(out["r3_shifted_vs_free_mean"] > max(10 * max(noise_mean, replay_mean), 1e-5),
             f"R3 replay of other experts changed logprobs by only {out['r3_shifted_vs_free_mean']} (mean; "
             f"noise {noise_mean}, replay {replay_mean})")
    try:
        trainer.compute_logprobs(batch)
        out["r3_missing_routes"] = "accepted"
    except RoutingReplayError:
        out["r3_missing_routes"] = "refused"
    _require(out["r3_missing_routes"] == "refused", "R3 accepted a batch without routed_experts")
    return out


def _step_metrics(metrics: dict) -> dict:
    keys = {"loss": "loss/total", "grad_norm": "optim/grad_norm", "update_successful": "optim/update_successful",
            "ratio_min": "loss/seq_importance_ratio_min", "ratio_max": "loss/seq_importance_ratio_max",
            "tokens_per_s": "perf/tokens_per_s"}
    return {short: float(metrics[key]) for short, key in keys.items()}


def check_throughput(device: str, size: str, steps: int, seq_len: int, num_seqs: int, workdir: str) -> dict:
    """Trainer tokens/s and MFU of a random-init Qwen3-MoE of ``SIZES[size]`` (module docstring).

    One untimed warm-up step, then ``steps`` timed ``train_step`` calls on a prepared batch (old
    logprobs computed once, not timed) of ``num_seqs`` sequences of ``seq_len`` tokens.
    MFU: `megarl.launch.mfu.mfu` with the device's dense bf16 peak (NaN on CPU).

    Raises:
        CheckFailed: a step was not finite or did not update.
    """
    from transformers import Qwen3MoeConfig

    from megarl.conversion.initial_weights import initial_weights
    from megarl.launch.mfu import active_params, mfu, peak_tflops
    from megarl.training.parallel_state import destroy_parallel
    from megarl.training.trainer_build import build_trainer

    _start_single_rank(device)
    hf_config = Qwen3MoeConfig(**SIZES[size], decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                               tie_word_embeddings=False, max_position_embeddings=max(4096, seq_len))
    hf_dir = Path(workdir) / f"qwen3_moe_{size}"
    hf_config.save_pretrained(hf_dir)  # config.json only: Megatron initialises the weights at random
    precision = "bf16" if device == "cuda" else "fp32"
    cfg = _config(hf_dir, device, precision, lr=1e-6, max_tokens_per_microbatch=4096)
    cfg.model.load_weights = False
    trainer = build_trainer(cfg, load_weights=initial_weights(cfg.model))
    num_params = sum(p.numel() for chunk in trainer.model_chunks for p in chunk.parameters())
    batch = random_batch(hf_config.vocab_size, [seq_len] * num_seqs, prompt_tokens=seq_len // 4, seed=1)
    start = time.perf_counter()
    batch = trainer.prepare_batch(batch)
    forward_s = time.perf_counter() - start
    step_metrics = [_step_metrics(trainer.train_step(batch)) for _ in range(steps + 1)]
    if device == "cuda":
        torch.cuda.synchronize()
    for m in step_metrics:
        _require(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["update_successful"] == 1,
                 f"throughput step not finite or not applied: {m}")
    tokens_per_s = sum(m["tokens_per_s"] for m in step_metrics[1:]) / steps  # the first is the warm-up
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = peak_tflops(device_name, precision)
    out = {"size": size, "device_name": device_name, "precision": precision, "num_params": num_params,
           "active_params": active_params(hf_config.to_dict()), "tokens_per_step": batch.num_tokens,
           "seq_len": seq_len, "old_logprob_tokens_per_s": batch.num_tokens / forward_s,
           "warmup_tokens_per_s": step_metrics[0]["tokens_per_s"], "tokens_per_s": tokens_per_s,
           "peak_tflops": peak, "mfu": mfu(hf_config.to_dict(), tokens_per_s, seq_len, 1, peak),
           "step_s": batch.num_tokens / tokens_per_s}
    if device == "cuda":
        out["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del trainer
    destroy_parallel(destroy_process_group=True)
    return out


def summary(result: dict) -> str:
    """One line of what a passed check measured."""
    r = result
    if r["check"] == "env":
        return (f"{r.get('device_name', 'cpu')}, Python {r['python']}, torch {r['torch']} (CUDA {r['cuda']}, "
                f"NCCL {r.get('nccl', '-')}), Megatron-Core {r['megatron_core']}, transformers {r['transformers']}, "
                f"Transformer Engine {r['transformer_engine']}")
    if r["check"] == "replay":
        steps = [r[name][k] for name in ("r3_step", "r2_step") for k in ("ratio_min", "ratio_max")]
        return (f"{r['spec']} spec, {r['precision']} on {r['device']}, {r['num_tokens']} tokens: |R2 old - free| "
                f"{r['r2_old_vs_free']:.2g}, |R3 replay - free| {r['r3_replay_vs_free']:.2g}, shifted routes "
                f"{r['r3_shifted_vs_free']:.2g} (mean {r['r3_shifted_vs_free_mean']:.2g}; tolerance "
                f"{r['tolerance']:g}); R3 and R2 steps: ratios "
                f"{min(steps):.6f}..{max(steps):.6f}, grad norms {r['r3_step']['grad_norm']:.3g} / "
                f"{r['r2_step']['grad_norm']:.3g}")
    memory = f", peak {r['max_memory_gib']:.1f} GiB" if "max_memory_gib" in r else ""
    return (f"Qwen3-MoE {r['size']} ({r['num_params'] / 1e6:.1f}M parameters, {r['active_params'] / 1e6:.1f}M "
            f"active), {r['precision']}, {r['tokens_per_step']} tokens/step of {r['seq_len']}: trainer "
            f"{r['tokens_per_s']:.0f} tokens/s ({r['step_s']:.2f} s/step), MFU {100 * r['mfu']:.1f}% of "
            f"{r['peak_tflops']:g} TFLOP/s ({r['device_name']}){memory}; old-logprob pass "
            f"{r['old_logprob_tokens_per_s']:.0f} tokens/s")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megarl.testing.gpu_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("check", choices=["env", "replay", "throughput"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--precision", choices=sorted(TOLERANCE), default=None,
                        help="replay: parameter precision (default: bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="throughput: model shape (default: 1b on cuda, small on cpu)")
    parser.add_argument("--steps", type=int, default=3, help="throughput: timed train steps (after one warm-up)")
    parser.add_argument("--seq-len", type=int, default=None, help="throughput: tokens per sequence")
    parser.add_argument("--num-seqs", type=int, default=None, help="throughput: sequences per step")
    parser.add_argument("--json", default=None, help="also write the result to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one check; print ``RESULT {json}``; 0 if it passed, 1 if an assertion failed.

    Raises:
        SystemExit: bad arguments (argparse, exit code 2).
    """
    from megarl.logging_setup import install as filter_known_noise

    args = _parser().parse_args(argv)
    filter_known_noise()  # Megatron's warnings about TE / apex fallbacks (megarl.logging_setup)
    if args.steps < 1:
        _parser().error("--steps must be >= 1")
    cuda = args.device == "cuda"
    result: dict = {"check": args.check, "device": args.device}
    try:
        with tempfile.TemporaryDirectory(prefix="megarl_gpu_check_") as workdir:
            if args.check == "env":
                result.update(check_env(args.device))
            elif args.check == "replay":
                result.update(check_replay(args.device, args.precision or ("bf16" if cuda else "fp32"), workdir))
            else:
                result.update(check_throughput(
                    args.device, args.size or ("1b" if cuda else "small"), args.steps,
                    args.seq_len or (1024 if cuda else 64), args.num_seqs or (32 if cuda else 8), workdir))
        result["ok"] = True
    except CheckFailed as err:
        result.update(ok=False, error=str(err))
    print("SUMMARY " + (summary(result) if result["ok"] else f"FAILED: {result['error']}"), flush=True)
    print("RESULT " + json.dumps(result, sort_keys=True), flush=True)  # NaN (MFU on CPU) prints as NaN
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
