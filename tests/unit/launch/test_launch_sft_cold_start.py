"""The SFT cold start prepared before Ray and run on the trainer (megarl.launch.sft).

References: the demonstrations each step trains are the ones ``ColdStart.order`` names, packed as
`TrainBatch.from_trajectories` packs them; every epoch covers each demonstration exactly once (a
permutation, reshuffled per epoch); ``sft_metrics.jsonl`` holds one line per step with what the
trainer returned.
"""
import json

import torch
from omegaconf import OmegaConf

from megarl.config.schema import SFTConfig
from megarl.data.sampler import ResumableSampler
from megarl.launch.sft import ColdStart, run_cold_start
from megarl.rollout.types import Trajectory


def _demo(i: int) -> Trajectory:
    return Trajectory(prompt_ids=torch.tensor([1, 2]), response_ids=torch.tensor([10 + i, 3]),
                      loss_mask=torch.tensor([1, 1]), rollout_logprobs=torch.zeros(2))


class _Trainer:
    def __init__(self):
        self.batches = []

    def sft_step(self, batch, *, lr):
        self.batches.append((batch, lr))
        return {"sft/nll": float(len(self.batches)), "sft/grad_norm": 0.5, "sft/num_tokens": 2.0}


def _cold_start(num_demos: int, steps: int, batch_size: int) -> ColdStart:
    sft = OmegaConf.structured(SFTConfig(num_steps=steps, batch_size=batch_size, lr=3e-5))
    sampler = ResumableSampler(num_demos, seed=7)
    return ColdStart(trajectories=[_demo(i) for i in range(num_demos)],
                     order=[sampler.next_indices(batch_size) for _ in range(steps)], sft=sft)


def test_each_step_trains_the_demonstrations_its_order_names(tmp_path):
    cold = _cold_start(num_demos=5, steps=5, batch_size=2)
    trainer = _Trainer()
    assert run_cold_start(trainer, cold, run_dir=tmp_path)
    assert len(trainer.batches) == 5
    for (batch, lr), indices in zip(trainer.batches, cold.order):
        assert lr == 3e-5
        expected = torch.cat([torch.tensor([1, 2, 10 + i, 3]) for i in indices])
        assert torch.equal(batch.input_ids, expected)
    first_epoch = [i for step in cold.order for i in step][:5]
    assert sorted(first_epoch) == list(range(5))  # an epoch is a permutation of the demonstrations
    lines = [json.loads(line) for line in (tmp_path / "sft_metrics.jsonl").read_text().splitlines()]
    assert [line["sft/nll"] for line in lines] == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_nothing_runs_without_demonstrations(tmp_path):
    trainer = _Trainer()
    assert not run_cold_start(trainer, None, run_dir=tmp_path)
    sft = OmegaConf.structured(SFTConfig(num_steps=3, batch_size=2))
    assert not run_cold_start(trainer, ColdStart(trajectories=[], order=[], sft=sft), run_dir=tmp_path)
    assert trainer.batches == [] and not (tmp_path / "sft_metrics.jsonl").exists()
