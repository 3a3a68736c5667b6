"""TrainBatch packing from trajectories, selection and validation."""
import pytest
import torch

from megarl.rollout.types import Trajectory
from megarl.training.batch import TrainBatch, packed_to_padded


def _traj(prompt, response, mask, routes=None, version=0):
    n = len(response)
    return Trajectory(prompt_ids=torch.tensor(prompt), response_ids=torch.tensor(response),
                      loss_mask=torch.tensor(mask), rollout_logprobs=-torch.arange(1, n + 1, dtype=torch.float32),
                      routed_experts=routes, policy_version=version, reward=float(n))


@pytest.mark.timeout(30)
def test_from_trajectories_packs_prompt_and_response():
    trajs = [_traj([1, 2], [3, 4, 5], [1, 0, 1], version=3), _traj([6], [7], [1])]
    batch = TrainBatch.from_trajectories(trajs, [0.5, -0.5])
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert batch.cu_seqlens.tolist() == [0, 5, 7]
    assert batch.loss_mask.tolist() == [False, False, True, False, True, False, True]
    # engine logprobs kept where trained, zero elsewhere (prompt and tool tokens)
    assert batch.rollout_logprobs.tolist() == [0, 0, -1, 0, -3, 0, -1]
    assert batch.policy_version.tolist() == [3, 0]
    assert batch.routed_experts is None
    assert batch.seq_lens.tolist() == [5, 2]


@pytest.mark.timeout(30)
def test_routed_experts_cover_prompt_and_response_rows():
    routes = torch.arange(5 * 2, dtype=torch.int32).reshape(5, 1, 2)  # [P + R = 5, L=1, K=2]
    other = torch.tensor([[[0, 1]], [[-1, -1]]], dtype=torch.int32)
    batch = TrainBatch.from_trajectories([_traj([9, 9, 9], [1, 2], [1, 1], routes=routes),
                                          _traj([4], [5], [1], routes=other)], [1.0, 0.0])
    assert batch.routed_experts.shape == (7, 1, 2)
    assert batch.routed_experts.tolist() == routes.tolist() + other.tolist()
    with pytest.raises(ValueError, match="Trajectory.routed_experts has 2 rows"):
        _traj([9, 9, 9], [1, 2], [1, 1], routes=routes[3:])  # response rows only: the prompt's are missing


@pytest.mark.timeout(30)
def test_mixed_routed_experts_rejected():
    routes = torch.tensor([[[0, 1]], [[-1, -1]]], dtype=torch.int32)
    with pytest.raises(ValueError, match="trajectory 1 has no routed_experts"):
        TrainBatch.from_trajectories([_traj([1], [2], [1], routes), _traj([1], [2], [1])], [0.0, 0.0])
    # a trajectory cut before its first turn (nothing trained) routes freely
    batch = TrainBatch.from_trajectories([_traj([1], [2], [1], routes), _traj([1, 3], [], [])], [0.0, 0.0])
    assert batch.routed_experts[2:].eq(-1).all() and batch.routed_experts.shape[0] == 4


@pytest.mark.timeout(30)
def test_select_reorders_all_fields():
    trajs = [_traj([1], [2, 3], [1, 1]), _traj([4, 5], [6], [1]), _traj([7], [8, 9, 10], [0, 1, 1])]
    batch = TrainBatch.from_trajectories(trajs, [1.0, 2.0, 3.0])
    sub = batch.select([2, 0])
    assert sub.input_ids.tolist() == [7, 8, 9, 10, 1, 2, 3]
    assert sub.cu_seqlens.tolist() == [0, 4, 7]
    assert sub.advantages.tolist() == [3.0, 1.0]
    assert sub.loss_mask.tolist() == [False, False, True, True, False, True, True]


@pytest.mark.timeout(30)
def test_validation_errors_name_the_field():
    ok = dict(input_ids=torch.tensor([1, 2, 3]), cu_seqlens=torch.tensor([0, 3]),
              loss_mask=torch.tensor([0, 1, 1]), advantages=torch.tensor([1.0]),
              rollout_logprobs=torch.zeros(3))
    TrainBatch(**ok)
    with pytest.raises(ValueError, match="cu_seqlens"):
        TrainBatch(**{**ok, "cu_seqlens": torch.tensor([0, 2])})
    with pytest.raises(ValueError, match="first token of sequence 0"):
        TrainBatch(**{**ok, "loss_mask": torch.tensor([1, 1, 1])})
    with pytest.raises(ValueError, match="advantages"):
        TrainBatch(**{**ok, "advantages": torch.tensor([1.0, 2.0])})
    with pytest.raises(ValueError, match="old_logprobs"):
        TrainBatch(**{**ok, "old_logprobs": torch.zeros(2)})
    with pytest.raises(ValueError, match="empty prompt"):
        TrainBatch.from_trajectories([_traj([], [1], [1])], [0.0])


@pytest.mark.timeout(30)
def test_packed_to_padded_against_loop():
    values = torch.arange(7, dtype=torch.float32)
    cu = torch.tensor([0, 5, 7])
    padded = packed_to_padded(values, cu, pad_value=-1.0)
    expected = torch.tensor([[0, 1, 2, 3, 4], [5, 6, -1, -1, -1]], dtype=torch.float32)
    assert torch.equal(padded, expected)
