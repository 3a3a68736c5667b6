"""`plan_step_bytes` against the tensors it sizes and the issue's own arithmetic for the 30B recipe.

References: the byte sizes of a real `TrainBatch`'s fields (``nbytes``), and Qwen3-30B-A3B's
``config.json`` (48 layers x top-8 x 4 B = 1.5 KB of R3 routes per token, issue 25).
"""
import json
from pathlib import Path

import pytest
import torch

from megarl.config.loader import load_config
from megarl.launch.data_plan import plan_step_bytes
from megarl.training.batch import TrainBatch

ROOT = Path(__file__).resolve().parents[3]


def test_bytes_per_token_and_sequence_are_the_batch_fields():
    lens = [5, 7, 9]
    total = sum(lens)
    cu = torch.tensor([0, 5, 12, 21])
    batch = TrainBatch(input_ids=torch.zeros(total, dtype=torch.int64), cu_seqlens=cu,
                       loss_mask=torch.zeros(total, dtype=torch.bool), advantages=torch.zeros(3),
                       rollout_logprobs=torch.zeros(total), rewards=torch.zeros(3))
    measured = sum(t.nbytes for t in (batch.input_ids, batch.loss_mask, batch.rollout_logprobs, batch.advantages,
                                      batch.policy_version, batch.rewards)) + batch.cu_seqlens[1:].nbytes
    cfg = load_config(None, ["rollout.num_prompts_per_step=1", "rollout.group_size=3", "train.routing_replay=none",
                             "cluster.trainer_nodes=1", "cluster.trainer_devices_per_node=1"])
    plan = plan_step_bytes(cfg, {"num_hidden_layers": 2}, mean_seq_tokens=total / 3)
    assert plan.driver_sent_bytes == pytest.approx(measured)
    assert plan.rank_received_bytes == pytest.approx(measured)
    assert plan.route_bytes_per_token == 0


def test_the_30b_recipe():
    cfg = load_config(str(ROOT / "configs/qwen3_30b_a3b_gpu.yaml"), [])
    model = json.loads((ROOT / "configs/models/qwen3-30b-a3b/config.json").read_text())
    plan = plan_step_bytes(cfg, model)
    assert plan.route_bytes_per_token == 48 * 8 * 4
    tokens = 32 * 8 * (2048 + 8192) / 2  # prompts x group size x mean of the length limits
    assert plan.tokens_per_step == tokens
    world, dp = 32, 8  # 4 nodes x 8 GPUs; TP2 x PP2
    assert plan.object_store_bytes == pytest.approx(tokens * (13 + 1536), rel=1e-3)
    assert plan.rank_received_bytes == pytest.approx(plan.object_store_bytes / dp)
    assert plan.baseline_rank_received_bytes == pytest.approx(plan.object_store_bytes)
    assert plan.baseline_driver_received_bytes > 50e9  # the "~100 GB into the driver per step"
    assert plan.driver_received_bytes < 1e6 and plan.driver_received_bytes / world < 30e3


def test_a_layout_that_does_not_divide_the_world_is_named():
    cfg = load_config(None, ["cluster.trainer_nodes=1", "cluster.trainer_devices_per_node=3",
                             "parallel.tensor_model_parallel_size=2"])
    with pytest.raises(ValueError, match="parallel.tensor_model_parallel_size"):
        plan_step_bytes(cfg, {"num_hidden_layers": 2})
