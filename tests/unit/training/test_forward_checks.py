"""megarl.training.forward's checks of what a step needs: a batch without old logprobs, or route
recording without the model's routing replay, is a ValueError naming what is missing (before: an
AttributeError or TypeError from deep inside, or none until the first micro batch)."""
import pytest
import torch

from megarl.config.schema import AlgorithmConfig
from megarl.rollout.types import Trajectory
from megarl.training import forward
from megarl.training.batch import TrainBatch


def _batch() -> TrainBatch:
    trajs = [Trajectory(prompt_ids=torch.tensor([1, 2]), response_ids=torch.tensor([3, 4, 5]),
                        loss_mask=torch.tensor([1, 0, 1]), rollout_logprobs=torch.tensor([-0.5, 0.0, -1.0])),
             Trajectory(prompt_ids=torch.tensor([6]), response_ids=torch.tensor([7]), loss_mask=torch.tensor([1]),
                        rollout_logprobs=torch.tensor([-2.0]))]
    return TrainBatch.from_trajectories(trajs, [0.5, -0.5])


@pytest.mark.timeout(30)
def test_a_batch_without_old_logprobs_is_named():
    batch = _batch()
    with pytest.raises(ValueError, match="no old_logprobs"):
        forward.loss_inputs(batch, AlgorithmConfig(), device="cpu", max_response_tokens=4)
    with pytest.raises(ValueError, match="no old_logprobs"):
        forward.mismatch(batch)
    old = torch.linspace(-1.0, -0.1, batch.num_tokens)
    inputs, metrics = forward.loss_inputs(batch.replace(old_logprobs=old), AlgorithmConfig(), device="cpu",
                                          max_response_tokens=4)
    assert torch.equal(inputs.old_logprobs, old) and metrics == {}
    assert float(inputs.normalizer.num_tokens) == 3.0 and float(inputs.normalizer.num_seqs) == 2.0  # by hand


@pytest.mark.timeout(30)
def test_route_recording_without_replay_fails_when_the_step_is_built():
    recorded = torch.zeros(7, 1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="needs the model's RoutingReplay"):
        forward.step_func(lambda *a: None, parallel=None, replay=None, routes=None, vocab_size=8, tp_group=None,
                          temperature=1.0, entropy="none", recorded=recorded)
    assert callable(forward.step_func(lambda *a: None, parallel=None, replay=None, routes=None, vocab_size=8,
                                      tp_group=None, temperature=1.0, entropy="none"))
