"""Routing-replay validation and the router slot's record / replay semantics."""
import pytest
import torch

from megarl.training.routing_replay import RoutingReplayError, _RouterSlot, validate_routed_experts


def _topk(scores, k, num_groups=None, group_topk=None):
    return torch.topk(scores, k=k, dim=1)


@pytest.mark.timeout(30)
def test_validation_accepts_good_and_unrecorded_rows():
    routes = torch.tensor([[[0, 3], [1, 2]], [[-1, -1], [-1, -1]], [[3, 0], [2, 1]]], dtype=torch.int32)
    validate_routed_experts(routes, num_layers=2, num_experts=4, topk=2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad, message", [
    ([[4, 0]], "num_moe_experts=4"),
    ([[1, 1]], "repeated"),
    ([[-1, 2]], "mixes -1"),
    ([[-2, -2]], "< -1"),
])
def test_validation_rejects_corrupted_ids(bad, message):
    routes = torch.zeros(5, 1, 2, dtype=torch.int64)
    routes[:, 0] = torch.tensor([0, 1])
    routes[3, 0] = torch.tensor(bad[0])
    with pytest.raises(RoutingReplayError, match=message) as err:
        validate_routed_experts(routes, num_layers=1, num_experts=4, topk=2, cu_seqlens=torch.tensor([0, 2, 5]))
    assert "sequence 1, position 1" in str(err.value)


@pytest.mark.timeout(30)
def test_validation_missing_and_shape():
    with pytest.raises(RoutingReplayError, match="no routed_experts"):
        validate_routed_experts(None, num_layers=2, num_experts=4, topk=2)
    with pytest.raises(RoutingReplayError, match="L=2, K=2"):
        validate_routed_experts(torch.zeros(3, 1, 2, dtype=torch.int64), num_layers=2, num_experts=4, topk=2)


@pytest.mark.timeout(30)
def test_slot_replays_ids_and_keeps_router_gradient():
    slot = _RouterSlot(0)
    logits = torch.randn(4, 6, requires_grad=True)
    slot.mode = "record"
    _, free = slot.get_replay_topk(logits, 2, default_compute_topk=_topk)
    assert torch.equal(slot.recorded[0], free)
    target = torch.tensor([[5, 0], [-1, -1], [2, 3], [1, 4]])
    slot.mode, slot.target = "replay", target
    probs, ids = slot.get_replay_topk(logits, 2, default_compute_topk=_topk)
    expected = target.clone()
    expected[1] = free[1]  # the unrecorded row routes freely
    assert torch.equal(ids, expected)
    torch.testing.assert_close(probs, logits.gather(1, expected))
    probs.sum().backward()
    assert logits.grad.abs().sum() > 0
    # a target is used once; a second forward without new routes is an error, not a stale replay
    with pytest.raises(RoutingReplayError, match="misaligned"):
        slot.get_replay_topk(logits, 2, default_compute_topk=_topk)


@pytest.mark.timeout(30)
def test_replayed_routes_move_to_the_router_device():
    """Issue 18 item 5: routes packed on the CPU replay on a router on another device (``meta``
    stands in for CUDA): the chosen ids end on the router's device with the router's dtype."""
    slot = _RouterSlot(0)
    slot.mode, slot.target = "replay", torch.tensor([[1, 0], [-1, -1]], dtype=torch.int32)
    probs, indices = slot.get_replay_topk(torch.randn(2, 4, device="meta"), 2, default_compute_topk=_topk)
    assert indices.device.type == probs.device.type == "meta"
    assert indices.dtype == torch.int64 and tuple(indices.shape) == (2, 2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_recomputed_router_replays_its_forward_routes(use_reentrant):
    """Activation checkpointing runs each router twice per micro batch (forward, then recomputed in
    the backward pass, in forward order): both calls must take that micro batch's routes."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    slot = _RouterSlot(0)
    slot.mode = "replay"
    seen = []

    def layer(logits):
        probs, ids = slot.get_replay_topk(logits, 2, default_compute_topk=_topk)
        seen.append(ids.clone())
        return probs

    targets = [torch.tensor([[5, 0], [2, 3]]), torch.tensor([[1, 4], [3, 0]])]
    logits = [torch.randn(2, 6, requires_grad=True) for _ in targets]
    outs = []
    with set_checkpoint_early_stop(False):  # non-reentrant: recompute the whole layer, so `seen` sees it
        for target, x in zip(targets, logits):  # two micro batches' forward passes, then their backwards
            slot.target = target
            outs.append(checkpoint(layer, x, use_reentrant=use_reentrant))
        for out in outs:
            out.sum().backward()
    assert [ids.tolist() for ids in seen] == [t.tolist() for t in targets + targets]
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in logits)
    # outside a backward pass, a call without fresh routes is still an error
    with pytest.raises(RoutingReplayError, match="misaligned"):
        slot.get_replay_topk(logits[0], 2, default_compute_topk=_topk)


@pytest.mark.timeout(30)
def test_dense_layer_rows_of_engine_routes_are_not_replayed():
    """SGLang's capture buffer leaves dense layers' rows zero-filled ([0, 0]: no valid top-k); the
    trainer routes them freely instead of rejecting the batch (DeepSeek-V3 / GLM-4.5 first layers)."""
    import types

    from megarl.training.batch import TrainBatch
    from megarl.training.routing_replay import replay_routes

    routes = torch.tensor([[[0, 0], [1, 2]], [[0, 0], [3, 0]]], dtype=torch.int32)  # layer 0 dense
    batch = TrainBatch(input_ids=torch.tensor([1, 2]), cu_seqlens=torch.tensor([0, 2]),
                       loss_mask=torch.tensor([False, True]), advantages=torch.zeros(1),
                       rollout_logprobs=torch.zeros(2), routed_experts=routes)
    config = types.SimpleNamespace(moe_layer_freq=[0, 1], num_moe_experts=4, moe_router_topk=2)
    replayed = replay_routes(batch, config, 2, enabled=True)
    assert replayed[:, 0].eq(-1).all() and torch.equal(replayed[:, 1], routes[:, 1])
    assert torch.equal(batch.routed_experts, routes)  # the batch is not modified
    config.moe_layer_freq = 1  # every layer MoE: the zero rows are invalid routes
    with pytest.raises(RoutingReplayError, match="repeated"):
        replay_routes(batch, config, 2, enabled=True)
