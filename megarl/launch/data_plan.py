"""Bytes an RL step moves between the driver, the object store and the trainer ranks (issue 25, part 1).

The step's data path (docs/architecture.md, "One RL step"): the driver puts one shard per
data-parallel rank in the Ray object store (token ids, loss mask, engine logprobs: `TOKEN_BYTES`
per token), R3 routes go from the rollout actor to the object store and on to the ranks that train
them (``L x K x 4`` bytes per token), and each rank returns metrics only. `plan_step_bytes`
predicts those sizes from the config and the model's ``config.json`` alone, next to the old
whole-batch path (every rank received the whole batch and returned it prepared) for comparison.
`tools/benchmarks/driver_bytes.py` measures them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from megarl.config.schema import MegarlConfig

TOKEN_BYTES = 8 + 1 + 4
"""Per token of a shard: ``input_ids`` int64, ``loss_mask`` bool, ``rollout_logprobs`` float32."""
SEQUENCE_BYTES = 8 + 4 + 8 + 4
"""Per sequence: ``cu_seqlens`` int64, ``advantages`` float32, ``policy_version`` int64, ``rewards`` float32."""
METRICS_BYTES = 4096
"""Upper bound of one rank's pickled metrics of one call (about 60 floats with their names)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepBytes:
    """Predicted bytes of one RL step (all sizes in bytes; serialisation overhead not counted).

    Attributes:
        tokens_per_step: ``num_prompts_per_step x group_size x mean sequence length``.
        route_bytes_per_token: ``L x K x 4`` with routing replay, else 0.
        driver_received_bytes: what the driver receives from the trainer ranks (metrics only).
        driver_sent_bytes: the shards the driver puts in the object store (no routes).
        rank_received_bytes: what one trainer rank reads: its shard and its sequences' R3 routes.
        object_store_bytes: shards plus R3 routes held in the object store during the step.
        rank_kept_bytes: what one rank keeps for its train steps (its prepared shard with old /
            reference logprobs and R2 / R3 routes).
        baseline_driver_received_bytes: the old path: every rank returned the whole prepared batch.
        baseline_rank_received_bytes: the old path: every rank received the whole batch.
    """

    tokens_per_step: float
    route_bytes_per_token: int
    driver_received_bytes: float
    driver_sent_bytes: float
    rank_received_bytes: float
    object_store_bytes: float
    rank_kept_bytes: float
    baseline_driver_received_bytes: float
    baseline_rank_received_bytes: float


def _model_layers_topk(model_config: dict[str, Any]) -> tuple[int, int]:
    """``(num_hidden_layers, experts per token)`` of a HF ``config.json`` (1 for a dense model)."""
    text = model_config.get("text_config", model_config)
    topk = text.get("num_experts_per_tok") or text.get("moe_topk") or 1
    return int(text["num_hidden_layers"]), int(topk)


def plan_step_bytes(cfg: MegarlConfig, model_config: dict[str, Any], *,
                    mean_seq_tokens: float | None = None) -> StepBytes:
    """Predict one RL step's driver, object-store and per-rank bytes.

    Args:
        cfg: the run config (``rollout.num_prompts_per_step``, ``rollout.group_size``,
            ``data.max_prompt_tokens``, ``rollout.agent.max_response_tokens``,
            ``train.routing_replay``, ``train.global_batch_size``, ``algorithm.kl_coef``,
            ``parallel.*`` sizes, ``cluster.trainer_nodes`` x ``cluster.trainer_devices_per_node``).
        model_config: the model's ``config.json`` as a dict (``num_hidden_layers``,
            ``num_experts_per_tok``).
        mean_seq_tokens: mean prompt + response tokens per trajectory; None: half of
            ``data.max_prompt_tokens + rollout.agent.max_response_tokens``.

    Returns:
        The `StepBytes`.

    Raises:
        ValueError: the parallel sizes do not divide the trainer world size (naming the keys).
    """
    par = cfg.parallel
    world = int(cfg.cluster.trainer_nodes) * int(cfg.cluster.trainer_devices_per_node)
    model_parallel = int(par.tensor_model_parallel_size) * int(par.pipeline_model_parallel_size) * int(
        par.context_parallel_size)
    if world % model_parallel:
        raise ValueError(f"cluster.trainer_nodes x cluster.trainer_devices_per_node = {world} is not a multiple of "
                         f"parallel.tensor_model_parallel_size x pipeline_model_parallel_size x "
                         f"context_parallel_size = {model_parallel}")
    dp = world // model_parallel
    num_seqs = int(cfg.rollout.num_prompts_per_step) * int(cfg.rollout.group_size)
    if mean_seq_tokens is None:
        mean_seq_tokens = (int(cfg.data.max_prompt_tokens) + int(cfg.rollout.agent.max_response_tokens)) / 2
    tokens = num_seqs * float(mean_seq_tokens)
    layers, topk = _model_layers_topk(model_config)
    replay = str(cfg.train.routing_replay)
    route = layers * topk * 4 if replay in ("r2", "r3") else 0
    r3_route = route if replay == "r3" else 0
    num_minis = -(-num_seqs // int(cfg.train.global_batch_size))
    batch_bytes = tokens * TOKEN_BYTES + num_seqs * SEQUENCE_BYTES
    logprob_fields = 4 * (1 + (float(cfg.algorithm.kl_coef) > 0))  # old (+ reference) logprobs
    return StepBytes(
        tokens_per_step=tokens, route_bytes_per_token=route,
        driver_received_bytes=float(world * METRICS_BYTES * (1 + num_minis)),
        driver_sent_bytes=batch_bytes,
        rank_received_bytes=(batch_bytes + tokens * r3_route) / dp,
        object_store_bytes=batch_bytes + tokens * r3_route,
        rank_kept_bytes=(batch_bytes + tokens * (logprob_fields + route)) / dp,
        baseline_driver_received_bytes=world * (batch_bytes + tokens * (logprob_fields + route)),
        baseline_rank_received_bytes=batch_bytes + tokens * r3_route,
    )
