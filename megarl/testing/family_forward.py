"""Megatron's logits of a family's tiny HF model on CPU ranks, for the forward-vs-transformers tests.

:func:`megatron_logits` is a :func:`megarl.testing.multiproc.run_ranks` rank function: it builds the
model at the given layout (the local spec, fp32), loads the HF weights through megarl's loader and
returns the full-vocabulary logits (all-gathered over TP), once with one sequence per row and, when
asked, once with the rows packed into one (a block-causal mask: each sequence attends to itself).
"""
from __future__ import annotations

from typing import Any

import torch


def megatron_logits(rank: int, world_size: int, hf_dir: str, tokens: torch.Tensor, parallel_kwargs: dict[str, Any],
                    packed: bool = False, device: str = "cpu") -> list[torch.Tensor]:
    """Logits of ``tokens`` ``[B, S]`` int64 at the layout ``parallel_kwargs`` (``ParallelConfig`` fields;
    sequence parallelism on when TP > 1), the model on ``device`` (``cpu``: gloo; ``cuda``: NCCL, this
    rank's current CUDA device).

    Returns:
        ``[logits]`` or, with ``packed``, ``[logits, packed_logits]``: each ``[B, S, V_padded]`` fp32 on
        the CPU (``packed_logits`` from the ``[1, B * S]`` row, reshaped back).
    """
    from megatron.core import parallel_state as mps

    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.conversion.load_hf import load_hf_weights
    from megarl.training import collectives
    from megarl.training.micro_batch import block_causal_mask
    from megarl.training.model import build_model
    from megarl.training.parallel_state import initialize_parallel

    tp = int(parallel_kwargs.get("tensor_model_parallel_size", 1))
    parallel = ParallelConfig(**parallel_kwargs, sequence_parallel=tp > 1)
    state = initialize_parallel(parallel, backend="nccl" if device == "cuda" else "gloo")
    chunks = build_model(hf_dir, parallel, ModelConfig(hf_path=hf_dir), device=device, spec="local")
    load_hf_weights(chunks, hf_dir, state)
    chunks[0].eval()
    tokens = tokens.to(chunks[0].embedding.word_embeddings.weight.device)
    batch, seq = tokens.shape
    with torch.no_grad():
        positions = torch.arange(seq, device=tokens.device)
        outputs = [chunks[0](tokens, positions.expand_as(tokens), None)]
        if packed:
            row = tokens.reshape(1, -1)
            mask = block_causal_mask([[seq] * batch], seq * batch).to(tokens.device)
            outputs.append(chunks[0](row, positions.repeat(batch).view(1, -1), mask).view(batch, seq, -1))
    if state.tp_size > 1:
        group = mps.get_tensor_model_parallel_group()
        outputs = [torch.cat(collectives.all_gather(logits.contiguous(), group=group), dim=-1) for logits in outputs]
    return [logits.float().cpu() for logits in outputs]


def forward_gaps(hf_dir, batch: int, seq: int, *, seed: int, device: str = "cuda",
                 timeout_s: float = 240) -> dict[str, float]:
    """The largest logit gap between megarl's Megatron model of ``hf_dir`` (local spec, fp32, world size
    1, on ``device``: ``cuda`` is an NCCL rank in a spawned process) and transformers' forward of the
    same directory on the CPU, for ``[batch, seq]`` random tokens (``seed``), one sequence per row
    and the rows packed into one.

    Returns:
        ``{"batched": max |diff|, "packed": max |diff|}`` over the real (unpadded) vocabulary.

    Raises:
        megarl.procs.local_ranks.RankError: the rank raised or timed out.
    """
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from megarl.procs.local_ranks import free_port
    from megarl.testing.multiproc import run_ranks

    vocab = json.loads((Path(hf_dir) / "config.json").read_text())["vocab_size"]
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(tokens).logits
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    (out,) = run_ranks(megatron_logits, 1, args=(str(hf_dir), tokens, {}, True, device), backend=None, env=env,
                       timeout_s=timeout_s, start_method="spawn")
    return {what: (logits[..., :vocab] - ref).abs().max().item() for logits, what in zip(out, ("batched", "packed"))}
