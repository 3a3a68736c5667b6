"""ResumableSampler: every epoch is a permutation, and a resumed sampler continues identically."""
import json

import pytest

from megarl.data.sampler import ResumableSampler


def test_each_epoch_is_a_permutation_and_epochs_differ():
    s = ResumableSampler(10, seed=3)
    epoch0, epoch1 = s.next_indices(10), s.next_indices(10)
    assert sorted(epoch0) == list(range(10)) and sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1
    assert s.epoch == 1


def test_batches_span_epoch_boundaries():
    s = ResumableSampler(5, seed=0, shuffle=False)
    assert s.next_indices(3) == [0, 1, 2]
    assert s.next_indices(4) == [3, 4, 0, 1]
    assert s.epoch == 1 and s.position == 2


@pytest.mark.parametrize("stop_after", [0, 1, 3, 7])
def test_resume_continues_like_an_uninterrupted_run(stop_after):
    reference = ResumableSampler(7, seed=11)
    expected = [reference.next_indices(3) for _ in range(10)]

    first = ResumableSampler(7, seed=11)
    drawn = [first.next_indices(3) for _ in range(stop_after)]
    saved = json.loads(json.dumps(first.state_dict()))  # must survive a JSON round trip
    resumed = ResumableSampler(7, seed=11)
    resumed.load_state_dict(saved)
    drawn += [resumed.next_indices(3) for _ in range(10 - stop_after)]
    assert drawn == expected


def test_seed_changes_order_and_mismatched_state_is_rejected():
    assert ResumableSampler(50, seed=1).next_indices(50) != ResumableSampler(50, seed=2).next_indices(50)
    state = ResumableSampler(50, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        ResumableSampler(50, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_rows"):
        ResumableSampler(49, seed=1).load_state_dict(state)


def test_bad_arguments():
    with pytest.raises(ValueError):
        ResumableSampler(0)
    with pytest.raises(ValueError):
        ResumableSampler(3).next_indices(0)
