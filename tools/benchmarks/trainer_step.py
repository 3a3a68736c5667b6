"""Tokens/s of one megarl training step vs a plain transformers forward + backward, same process.

Both sides train the same Hugging Face model (default: the tiny Qwen3-MoE of
``megarl.models.tiny``, fp32, CPU) on the same GSM8K-length batch (prompt = chat-templated
question, response = reference answer, tokenised with the model's tokenizer):

- megarl: ``Trainer.train_step`` (Megatron-Core, TP1, world size 1; token-budget micro batches;
  vocab-parallel logprobs; GSPO loss; DDP; Adam step), old logprobs computed beforehand (untimed).
- transformers: ``AutoModelForCausalLM``, the same sequences sorted by length into micro batches
  under the same token budget (padded, with an attention mask), log-softmax logprobs, the same GSPO
  formula, ``backward``, ``torch.optim.AdamW`` step.

tokens/s = real (unpadded) tokens of the batch / wall time of the step; median of ``--repeats``
steps after one warm-up step each, the two sides alternating step by step so that both see the
same machine load. ``peak_step_mb``: the most CPU memory a step holds beyond what was live before
it (activations, logits, gradients, temporaries; `peak_step_mb`), from one extra untimed step.
Two variants: ``default`` (one GSM8K question and answer per sequence) and ``long`` (a conversation
of ``--long-turns`` of them per sequence, ``--long-max-tokens`` budget): packing's advantage over
padding grows with length. On a shared machine the ratio of CPU-time rates (``ratio_cpu_time``,
``time.process_time``) is the steadier number; both are reported. Also reports the trainer's padding fraction on
GSM8K-length batches
of several sizes, data-parallel sizes and token budgets. Prints one JSON object.

usage: python tools/benchmarks/trainer_step.py [--hf-dir DIR] [--num-seqs 32] [--max-tokens 4096]
                                              [--long-turns 4] [--long-max-tokens 8192] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def gsm8k_sequences(tokenizer, num: int, seed: int, turns: int = 1) -> list[tuple[list[int], list[int]]]:
    """``num`` (prompt_ids, response_ids) pairs from GSM8K train rows.

    ``turns > 1``: each sequence is a conversation of ``turns`` GSM8K questions and answers (the
    earlier exchanges in the prompt, the last answer as the response): ``turns`` times longer.
    """
    from megarl.models.tiny_tokenizer import default_gsm8k_dir

    rows = [json.loads(line) for line in open(default_gsm8k_dir() / "train.jsonl")]
    rows = random.Random(seed).sample(rows, num * turns)
    out = []
    for i in range(num):
        chat = []
        for row in rows[i * turns:(i + 1) * turns]:
            chat += [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]
        prompt = tokenizer.apply_chat_template(chat[:-1], add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        response_ids = tokenizer(chat[-1]["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        out.append((prompt_ids, response_ids))
    return out


def make_batch(sequences, seed: int):
    from megarl.training.batch import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    ids, masks, lens = [], [], []
    for prompt, response in sequences:
        ids += prompt + response
        masks += [False] * len(prompt) + [True] * len(response)
        lens.append(len(prompt) + len(response))
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    return TrainBatch(input_ids=torch.tensor(ids), cu_seqlens=cu, loss_mask=torch.tensor(masks),
                      advantages=torch.randn(len(lens), generator=gen), rollout_logprobs=torch.zeros(len(ids)))


def megarl_trainer(hf_dir: str):
    """A world-size-1 fp32 CPU `Trainer` of the model (GSPO, the default config otherwise)."""
    from megarl.config.schema import MegarlConfig
    from megarl.conversion.initial_weights import initial_weights
    from megarl.training.trainer_build import build_trainer

    cfg = MegarlConfig()
    cfg.model.hf_path, cfg.cluster.device, cfg.train.precision = hf_dir, "cpu", "fp32"
    cfg.train.lr = 1e-6
    cfg.parallel.use_distributed_optimizer = False  # world size 1: nothing to shard
    return build_trainer(cfg, load_weights=initial_weights(cfg.model))


def megarl_step(trainer, batch, max_tokens: int):
    """``(step, info)``: ``step()`` runs one ``Trainer.train_step`` and returns its wall and CPU time."""
    trainer.cfg.train.max_tokens_per_microbatch = max_tokens
    prepared = trainer.prepare_batch(batch)
    info = {}

    def step() -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        metrics = trainer.train_step(prepared)
        info.update(padding_fraction=metrics["batch/padding_fraction"],
                    num_microbatches=metrics["batch/num_microbatches"])
        return time.perf_counter() - start, time.process_time() - cpu

    return step, info


def _hf_micro_batches(lens: list[int], max_tokens: int) -> list[list[int]]:
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    batches, current = [], []
    for i in order:  # longest first, so a micro batch's padded size is its first length x count
        if current and lens[current[0]] * (len(current) + 1) > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current] if current else batches


def transformers_step(hf_dir: str, batch, max_tokens: int):
    """``(step, info)`` for the plain transformers forward + backward + AdamW step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)
    lens = batch.seq_lens.tolist()
    seqs = [batch.input_ids[batch.cu_seqlens[i]:batch.cu_seqlens[i + 1]] for i in range(len(lens))]
    masks = [batch.loss_mask[batch.cu_seqlens[i]:batch.cu_seqlens[i + 1]] for i in range(len(lens))]
    micro = _hf_micro_batches(lens, max_tokens)

    def step() -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        for group in micro:
            width = max(lens[i] for i in group)
            ids = torch.zeros(len(group), width, dtype=torch.int64)
            attn = torch.zeros(len(group), width, dtype=torch.int64)
            loss_mask = torch.zeros(len(group), width)
            for row, i in enumerate(group):
                ids[row, :lens[i]], attn[row, :lens[i]], loss_mask[row, :lens[i]] = seqs[i], 1, masks[i].float()
            logits = model(input_ids=ids, attention_mask=attn).logits
            logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            mask = loss_mask[:, 1:]
            ratio = torch.exp(((logp - logp.detach()) * mask).sum(-1) / mask.sum(-1).clamp(min=1))  # GSPO s_i
            adv = batch.advantages[group]
            loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - 3e-4, 1 + 4e-4)).sum() / len(lens)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return time.perf_counter() - start, time.process_time() - cpu

    padded = sum(max(lens[i] for i in g) * len(g) for g in micro)
    return step, {"padding_fraction": 1 - batch.num_tokens / padded, "num_microbatches": len(micro)}


def padding_table(tokenizer, seed: int) -> list[dict]:
    """Trainer padding fraction on GSM8K-length batches (sizes x DP x budgets)."""
    from megarl.training.batching import plan_micro_batches

    out = []
    for num in (64, 256):
        lens = [len(p) + len(r) for p, r in gsm8k_sequences(tokenizer, num, seed + num)]
        for dp in (1, 2):
            for budget in (2048, 4096):
                for multiple in (1, 2):
                    plan = plan_micro_batches(lens, dp_size=dp, max_tokens_per_microbatch=budget, pad_multiple=multiple)
                    out.append({"num_seqs": num, "dp_size": dp, "max_tokens": budget, "pad_multiple": multiple,
                                "num_microbatches": plan.num_microbatches,
                                "padding_fraction": round(plan.padding_fraction, 4)})
    return out


def _init_single_rank() -> None:
    import torch.distributed as dist

    from megarl.procs.local_ranks import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)


def peak_step_mb(step) -> float:
    """Peak of the CPU memory one ``step()`` allocates beyond what was live before it (MiB): the
    running sum of torch's CPU allocations and frees (``torch.profiler`` memory events), so the
    activations, logits, gradients and temporaries of the step, not the weights or optimizer state
    that persist across steps. Run untimed (the profiler slows the step)."""
    from megarl.testing.peak_memory import peak_cpu_bytes

    return peak_cpu_bytes(step) / 2**20


def measure(steps: dict, num_tokens: int, repeats: int) -> dict:
    """Median wall / CPU time of ``repeats`` steps per side (alternating, after a warm-up step), and
    each side's peak step memory."""
    for step, _ in steps.values():
        step()  # warm-up
    peaks = {name: peak_step_mb(step) for name, (step, _) in steps.items()}
    times = {name: [] for name in steps}
    for _ in range(repeats):  # alternate, so both see the same machine load
        for name, (step, _) in steps.items():
            times[name].append(step())
    results = {}
    for name in steps:
        wall = statistics.median(t for t, _ in times[name])
        cpu = statistics.median(c for _, c in times[name])
        results[name] = {"step_s": wall, "step_cpu_s": cpu, "tokens_per_s": num_tokens / wall,
                         "tokens_per_cpu_s": num_tokens / cpu, "peak_step_mb": peaks[name], **steps[name][1]}
    megarl, hf = results["megarl"], results["transformers"]
    return {"megarl": megarl, "transformers": hf,
            "ratio_megarl_over_transformers": megarl["tokens_per_s"] / hf["tokens_per_s"],
            "ratio_cpu_time": megarl["tokens_per_cpu_s"] / hf["tokens_per_cpu_s"],
            "ratio_peak_memory": megarl["peak_step_mb"] / hf["peak_step_mb"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-dir", help="HF model directory (default: make the tiny Qwen3-MoE)")
    parser.add_argument("--num-seqs", type=int, default=32, help="sequences in the timed batch")
    parser.add_argument("--max-tokens", type=int, default=4096, help="max_tokens_per_microbatch (both sides)")
    parser.add_argument("--long-turns", type=int, default=4,
                        help="GSM8K exchanges per sequence of the longer-sequence variant (0: skip it)")
    parser.add_argument("--long-max-tokens", type=int, default=8192, help="token budget of the longer variant")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(args.seed)
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = args.hf_dir
        if hf_dir is None:
            from megarl.models.tiny import TinyModelSpec, make_tiny_model

            hf_dir = str(make_tiny_model(Path(tmp) / "tiny_moe", TinyModelSpec(family="qwen3_moe")))
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        _init_single_rank()
        trainer = megarl_trainer(hf_dir)
        variants = {"default": (1, args.max_tokens)}
        if args.long_turns > 0:
            variants["long"] = (args.long_turns, args.long_max_tokens)
        report = {"threads": torch.get_num_threads(), "load_average": os.getloadavg()}
        for name, (turns, max_tokens) in variants.items():
            batch = make_batch(gsm8k_sequences(tokenizer, args.num_seqs, args.seed, turns=turns), args.seed)
            steps = {"megarl": megarl_step(trainer, batch, max_tokens),
                     "transformers": transformers_step(hf_dir, batch, max_tokens)}
            report[name] = {"num_seqs": args.num_seqs, "turns": turns, "num_tokens": batch.num_tokens,
                            "max_tokens": max_tokens, **measure(steps, batch.num_tokens, args.repeats)}
        report["load_average_after"] = os.getloadavg()
        report["padding_gsm8k"] = padding_table(tokenizer, args.seed)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
