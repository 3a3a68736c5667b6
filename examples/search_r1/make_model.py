#!/usr/bin/env python3
"""The search demonstration's policy: the tiny Qwen3-MoE, pretrained to copy before any task data.

    python examples/search_r1/make_model.py OUT_DIR [--seed 0] [--steps 2000]

A search agent copies twice: words of the question into the search call, and the answer out of the
retrieved passage. A real policy brings that from pretraining (induction heads, Olsson et al. 2022,
arXiv:2209.11895); the tiny random-init model of ``examples/arithmetic_tool/make_model.py`` does
not, and 250 steps of SFT on search demonstrations never formed it (seven variants, held-out
reward 0.000, README.md). So the model is first pretrained, here, on a synthetic task that holds no
knowledge of the corpus or the questions: sequences of tokens drawn uniformly from the whole
vocabulary in which a span ``m s_1 .. s_k`` is repeated later in the sequence; the loss is the
next-token cross-entropy on the tokens after the repeated marker ``m`` (``s_1 .. s_k``), which only
copying can predict. Every token of the vocabulary is an output target equally often, so the output
layer can emit a token the task data never showed (held-out titles). Then the SFT cold start teaches
the task's format (what to copy, from where), and GSPO what it rewards.

Deviation from a real pretraining: no language modelling (the tokens are random), so the model
knows nothing; what it gets is the copying mechanism alone. Runs with transformers on CPU in
~2-4 minutes at the default sizes (2 cores); prints the held-out copy accuracy it reached.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def copy_batch(generator, batch: int, length: int, vocab: list[int], *, spans: int = 3,
               span_min: int = 4, span_max: int = 24, alphabets: tuple[int, ...] = (0, 256, 48)):
    """Random sequences with repeated spans, and the loss mask of what copying predicts.

    Args:
        generator: ``torch.Generator`` (the batch is a function of its state).
        batch, length: the shape ``[batch, length]`` of the result.
        vocab: token ids to draw from (ordinary tokens, no special ones).
        spans: repeated spans per sequence; each is ``1 + k`` tokens (marker + ``k`` in
            ``[span_min, span_max]``), first at a position in the first half, again in the second.
        alphabets: each sequence draws its tokens from a random subset of ``vocab`` of one of these
            sizes (0 = all of it), chosen uniformly. In a small alphabet a token recurs, so the one
            token before a position does not say where to copy from: the model has to match longer
            contexts, as in natural text (a word's pieces recur across words).

    Returns:
        ``(input_ids [batch, length] int64, loss_mask [batch, length] bool)``: ``loss_mask[b, t]``
        marks position ``t`` whose token the model predicts from ``t - 1`` and that is a copied
        ``s_i`` (the marker's second occurrence itself is not predictable and is not marked).
    """
    import torch

    table = torch.tensor(vocab, dtype=torch.int64)
    ids = torch.empty(batch, length, dtype=torch.int64)
    for b in range(batch):
        size = alphabets[int(torch.randint(len(alphabets), (1,), generator=generator))]
        size = len(vocab) if size <= 0 else min(size, len(vocab))
        alphabet = table[torch.randperm(len(vocab), generator=generator)[:size]]
        ids[b] = alphabet[torch.randint(size, (length,), generator=generator)]
    mask = torch.zeros(batch, length, dtype=torch.bool)
    half = length // 2
    slot = half // spans
    for b in range(batch):
        for s in range(spans):
            k = int(torch.randint(span_min, span_max + 1, (1,), generator=generator))
            k = min(k, slot - 1)
            src = s * slot + int(torch.randint(0, slot - k, (1,), generator=generator))
            dst = half + s * slot + int(torch.randint(0, slot - k, (1,), generator=generator))
            ids[b, dst:dst + k + 1] = ids[b, src:src + k + 1]
            mask[b, dst + 1:dst + k + 1] = True
    return ids, mask


def copy_accuracy(model, batch: int, length: int, vocab: list[int], seed: int) -> float:
    """Greedy next-token accuracy of ``model`` on the copied positions of 8 held-out batches."""
    import torch

    held_out = torch.Generator().manual_seed(10_000 + seed)
    right = total = 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for _ in range(8):
            ids, mask = copy_batch(held_out, batch, length, vocab)
            predicted = model(input_ids=ids).logits[:, :-1].argmax(-1)
            hit = (predicted == ids[:, 1:]) & mask[:, 1:]
            right, total = right + int(hit.sum()), total + int(mask[:, 1:].sum())
    model.train(was_training)
    return right / total


def pretrain_copy(model_dir: str | Path, *, steps: int = 2000, max_steps: int = 8000, min_accuracy: float = 0.9,
                  eval_every: int = 250, batch: int = 32, length: int = 128, lr: float = 3e-3, seed: int = 0,
                  log_every: int = 100) -> dict:
    """Pretrain the HF model in ``model_dir`` in place on :func:`copy_batch` sequences.

    AdamW (betas 0.9/0.95, weight decay 0.01), linear warm-up over 5% of ``steps`` then cosine decay
    to 10% over ``max_steps``, gradient clipping at 1.0, fp32. From ``steps`` on, the held-out copy
    accuracy is measured every ``eval_every`` steps and training stops once it reaches
    ``min_accuracy`` (or at ``max_steps``): copying forms in a sudden transition whose step varies
    with the machine's floating-point rounding (2,000 steps gave 0.945 on one machine, 0.537 on
    another), so a fixed step count is not a recipe.

    Returns:
        ``{"copy_accuracy", "loss", "seconds", "steps"}``: the greedy next-token accuracy on the
        masked positions of 8 held-out batches when training stopped, and the steps it took.
    """
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)
    horizon = max(steps, max_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0, s - warmup) / max(1, horizon - warmup))))))
    generator = torch.Generator().manual_seed(seed)
    started, loss = time.monotonic(), float("nan")
    accuracy, done, evaluated_at = float("nan"), 0, -1
    for step in range(horizon):
        ids, mask = copy_batch(generator, batch, length, vocab)
        logits = model(input_ids=ids).logits[:, :-1]
        target = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
        loss_t = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss = float(loss_t.detach())
        done = step + 1
        if log_every and done % log_every == 0:
            print(f"copy pretraining step {done}/{horizon}: loss {loss:.3f} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
        if done >= steps and (done - steps) % eval_every == 0:
            accuracy, evaluated_at = copy_accuracy(model, batch, length, vocab, seed), done
            print(f"copy pretraining step {done}: held-out copy accuracy {accuracy:.3f}", flush=True)
            if accuracy >= min_accuracy:
                break
    if evaluated_at != done:
        accuracy = copy_accuracy(model, batch, length, vocab, seed)
    model.eval()
    model.save_pretrained(model_dir, safe_serialization=True)
    return {"copy_accuracy": accuracy, "loss": loss, "seconds": time.monotonic() - started, "steps": done}


def make_model(out_dir: str | Path, seed: int = 0, *, steps: int = 2000) -> Path:
    """Write the tiny model (arithmetic demo's) into ``out_dir`` and copy-pretrain it (skipped when
    ``out_dir/copy_pretraining.json`` exists: the model there is finished)."""
    out = Path(out_dir)
    record = out / "copy_pretraining.json"
    if record.is_file():
        return out
    # The arithmetic demo's make_model.py, under its own module name (this file has the same name).
    spec = importlib.util.spec_from_file_location("arithmetic_make_model", HERE.parent / "arithmetic_tool" / "make_model.py")
    arithmetic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(arithmetic)
    arithmetic.make_model(out, seed)
    result = pretrain_copy(out, steps=steps, seed=seed)
    print(f"copy pretraining: held-out copy accuracy {result['copy_accuracy']:.3f} after {result['steps']} steps "
          f"({result['seconds']:.0f} s)", flush=True)
    record.write_text(json.dumps({"seed": seed, **result}, indent=2) + "\n")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    print(make_model(args.out_dir, args.seed, steps=args.steps))
