"""Shared pieces of the trainer integration tests (imported by the spawned ranks too)."""
from __future__ import annotations

import gc

import torch

from megarl.config.schema import MegarlConfig
from megarl.training.batch import TrainBatch

LAYOUTS = {
    "tp1": {},
    "tp2_sp": {"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": True},
    "ep2_allgather": {"parallel.expert_model_parallel_size": 2, "model.moe_token_dispatcher_type": "allgather"},
    "ep2_alltoall": {"parallel.expert_model_parallel_size": 2, "model.moe_token_dispatcher_type": "alltoall"},
    "pp2": {"parallel.pipeline_model_parallel_size": 2},
    "tp2_ep2_etp1": {"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": True,
                     "parallel.expert_model_parallel_size": 2, "parallel.expert_tensor_parallel_size": 1},
}
"""World-size-2 layouts, as ``section.key`` overrides."""


def make_cfg(hf_dir: str, overrides: dict | None = None) -> MegarlConfig:
    """A small CPU training config for the tiny model (fp32, token-budget micro batches)."""
    cfg = MegarlConfig()
    cfg.model.hf_path = str(hf_dir)
    cfg.cluster.device = "cpu"
    cfg.train.precision = "fp32"
    cfg.train.lr = 1e-3
    cfg.train.num_steps = 10
    cfg.train.max_tokens_per_microbatch = 24  # several micro batches per rank
    cfg.parallel.use_distributed_optimizer = True
    for key, value in (overrides or {}).items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def make_batch(vocab_size: int, *, seed: int = 0, num_seqs: int = 6) -> TrainBatch:
    """Random sequences: prompts of 3-6 tokens, responses of 4-14 tokens, a masked tool span."""
    gen = torch.Generator().manual_seed(seed)
    lens, masks = [], []
    for _ in range(num_seqs):
        prompt = int(torch.randint(3, 7, (1,), generator=gen))
        response = int(torch.randint(4, 15, (1,), generator=gen))
        mask = torch.cat([torch.zeros(prompt, dtype=torch.bool), torch.ones(response, dtype=torch.bool)])
        if response > 8:
            mask[prompt + 3:prompt + 5] = False  # tool-observation tokens are not trained
        lens.append(prompt + response)
        masks.append(mask)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    total = int(cu[-1])
    return TrainBatch(input_ids=torch.randint(0, vocab_size, (total,), generator=gen), cu_seqlens=cu,
                      loss_mask=torch.cat(masks), advantages=torch.randn(num_seqs, generator=gen),
                      rollout_logprobs=torch.zeros(total))


def build(cfg: MegarlConfig):
    """A trainer on a freshly initialised parallel state."""
    from megarl.conversion.initial_weights import initial_weights
    from megarl.training.trainer_build import build_trainer

    return build_trainer(cfg, load_weights=initial_weights(cfg.model))


def teardown(trainer) -> None:
    """Drop the trainer and Megatron's parallel state, so another layout can be built."""
    from megarl.training.parallel_state import destroy_parallel

    del trainer
    gc.collect()
    destroy_parallel()
