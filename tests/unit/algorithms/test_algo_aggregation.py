"""Split invariance: micro batches x data-parallel ranks == the whole batch (float64).

A shared weight ``W`` produces every token's logprob, so each micro batch's gradient lands on all of
``W``. Each simulated data-parallel rank holds its own copy of ``W``, accumulates gradients over its
micro batches (backward = sum), and the ranks' gradients are summed (an all-reduce SUM). The global
`LossNormalizer` is the sum of the micro batches' counts over all ranks. Every micro batch is
cropped to its own padded width, as a real packer would. "Exactly" means up to float64 summation
order: relative difference <= 1e-12.
"""

from __future__ import annotations

import functools

import pytest
import torch

from megarl.algorithms import (
    entropy_bonus_loss,
    gspo_loss,
    gspo_token_loss,
    kl_penalty_loss,
    ppo_clip_loss,
    reduce_metrics,
)
from megarl.algorithms.aggregation import LOSS_AGG_MODES, LossNormalizer, aggregate_loss
from megarl.algorithms.metrics import mean_over_steps

pytestmark = pytest.mark.timeout(60)

BATCH, WIDTH, HIDDEN, VOCAB, MAX_RESPONSE_TOKENS = 12, 10, 5, 7, 16
# Sequence indices per rank, split into micro batches of uneven sizes.
LAYOUT = [[[0], [1, 2, 3]], [[4, 5], [6, 7]], [[8, 9, 10, 11]]]


def _data():
    gen = torch.Generator().manual_seed(7)
    features = torch.randn(BATCH, WIDTH, HIDDEN, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, VOCAB, (BATCH, WIDTH), generator=gen)
    weight = 0.5 * torch.randn(HIDDEN, VOCAB, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, WIDTH + 1, (BATCH,), generator=gen)
    mask = (torch.arange(WIDTH)[None] < lengths[:, None]) & (torch.rand(BATCH, WIDTH, generator=gen) > 0.15)
    mask[:, 0] = True
    mask[5] = False  # a sequence without loss tokens, in the middle of a micro batch
    shift = lambda: 0.1 * torch.randn(BATCH, WIDTH, generator=gen, dtype=torch.float64)  # noqa: E731
    with torch.no_grad():
        base = torch.log_softmax(features @ weight, -1).gather(-1, tokens[..., None]).squeeze(-1)
    return {
        "features": features,
        "tokens": tokens,
        "mask": mask,
        "old": base + shift(),
        "ref": base + shift(),
        "advantages": torch.randn(BATCH, generator=gen, dtype=torch.float64),
        "token_advantages": torch.randn(BATCH, WIDTH, generator=gen, dtype=torch.float64),
    }, weight


def _forward(weight, data, rows):
    """Logprobs and entropy of the rows, cropped to their own padded width."""
    width = int(data["mask"][rows].any(0).nonzero().max()) + 1
    pick = {k: v[rows][:, :width] if v.dim() >= 2 else v[rows] for k, v in data.items()}
    log_probs = torch.log_softmax(pick["features"] @ weight, -1)
    logprobs = log_probs.gather(-1, pick["tokens"][..., None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logprobs, entropy, pick


def _loss_cases():
    def gspo(lp, ent, d, **kw):
        return gspo_loss(lp, d["old"], d["advantages"], d["mask"], clip_low=0.05, clip_high=0.08, entropy=ent, **kw)

    def gspo_tok(lp, ent, d, **kw):
        return gspo_token_loss(lp, d["old"], d["token_advantages"], d["mask"], clip_low=0.05, clip_high=0.08, **kw)

    def ppo(lp, ent, d, **kw):
        clips = dict(clip_low=0.1, clip_high=0.12, clip_c=1.1)
        return ppo_clip_loss(lp, d["old"], d["token_advantages"], d["mask"], **clips, **kw)

    def kl(lp, ent, d, **kw):
        return kl_penalty_loss(lp, d["ref"], d["mask"], kl_coef=0.3, old_logprobs=d["old"], **kw)

    def bonus(lp, ent, d, **kw):
        return entropy_bonus_loss(ent, d["mask"], entropy_coef=0.01, **kw)

    return {"gspo": gspo, "gspo_token": gspo_tok, "ppo_clip": ppo, "kl_is_k3": kl, "entropy": bonus}


def _whole_and_split(loss_fn, mode):
    data, weight0 = _data()
    whole_w = weight0.clone().requires_grad_()
    logprobs, entropy, pick = _forward(whole_w, data, list(range(BATCH)))
    normalizer = LossNormalizer.from_loss_mask(data["mask"], max_response_tokens=MAX_RESPONSE_TOKENS)
    whole_loss, whole_metrics = loss_fn(logprobs, entropy, pick, loss_agg_mode=mode, normalizer=normalizer)
    whole_loss.backward()

    micro = [rows for rank in LAYOUT for rows in rank]
    counts = [LossNormalizer.from_loss_mask(data["mask"][r], max_response_tokens=MAX_RESPONSE_TOKENS) for r in micro]
    global_normalizer = functools.reduce(lambda a, b: a + b, counts)
    split_loss, split_grad, split_metrics = 0.0, torch.zeros_like(weight0), []
    for rank in LAYOUT:
        rank_w = weight0.clone().requires_grad_()
        for rows in rank:
            logprobs, entropy, pick = _forward(rank_w, data, rows)
            loss, metrics = loss_fn(logprobs, entropy, pick, loss_agg_mode=mode, normalizer=global_normalizer)
            loss.backward()
            split_loss += loss.item()
            split_metrics.append(metrics)
        split_grad += rank_w.grad  # all-reduce SUM over data-parallel ranks
    return (whole_loss.item(), whole_w.grad, whole_metrics), (split_loss, split_grad, reduce_metrics(split_metrics))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("case", list(_loss_cases()))
def test_micro_batch_times_dp_split_equals_whole_batch(case, mode):
    (whole_loss, whole_grad, _), (split_loss, split_grad, _) = _whole_and_split(_loss_cases()[case], mode)
    assert split_loss == pytest.approx(whole_loss, rel=1e-12, abs=1e-15)
    assert torch.allclose(split_grad, whole_grad, rtol=1e-12, atol=1e-15 * whole_grad.abs().max())
    assert whole_grad.abs().max() > 1e-6


@pytest.mark.parametrize("case", ["gspo", "ppo_clip"])
def test_reduced_metrics_equal_whole_batch_metrics(case):
    (_, _, whole), (_, _, split) = _whole_and_split(_loss_cases()[case], "token_mean")
    assert set(whole) == set(split)
    for name, metric in whole.items():
        assert split[name].reduction == metric.reduction, name
        assert split[name].value.item() == pytest.approx(metric.value.item(), rel=1e-12, abs=1e-15), name
        if metric.reduction == "mean":
            assert split[name].weight.item() == metric.weight.item(), name


def test_local_normalisation_would_not_be_split_invariant():
    """Negative control: averaging per-micro-batch token means differs from the whole-batch mean."""
    data, _ = _data()
    values = data["old"]
    whole = aggregate_loss(values, data["mask"], "token_mean")
    micro = [rows for rank in LAYOUT for rows in rank]
    naive = sum(aggregate_loss(values[rows], data["mask"][rows], "token_mean") for rows in micro) / len(micro)
    assert abs(naive.item() - whole.item()) > 1e-3


def test_sum_norm_divides_by_constant_not_padded_width():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    losses = torch.tensor([[1.0, 2.0, 50.0, 50.0], [4.0, 60.0, 60.0, 60.0]], dtype=torch.float64)
    normalizer = LossNormalizer(num_tokens=3, num_seqs=2, max_response_tokens=8)
    loss = aggregate_loss(losses, mask, "seq_mean_token_sum_norm", normalizer)
    assert loss.item() == pytest.approx((1 + 2 + 4) / (2 * 8))
    assert aggregate_loss(losses[:, :2], mask[:, :2], "seq_mean_token_sum_norm", normalizer).item() == loss.item()


def test_unknown_mode_and_bad_shapes_are_rejected():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="loss_agg_mode must be one of"):
        aggregate_loss(torch.zeros(2, 3), mask, "token-mean")
    with pytest.raises(ValueError, match="token_losses shape"):
        aggregate_loss(torch.zeros(2, 4), mask, "token_mean")


def test_empty_micro_batch_is_the_identity_of_metric_reduction():
    """A micro batch with no loss tokens (even B = 0) changes neither the loss nor any metric."""
    data, weight = _data()
    logprobs, entropy, pick = _forward(weight, data, list(range(BATCH)))
    case = _loss_cases()["gspo"]
    _, metrics = case(logprobs, entropy, pick)
    empty_mask = {**pick, "mask": torch.zeros_like(pick["mask"])}
    empty_loss, empty_metrics = case(logprobs, entropy, empty_mask)
    none = {k: v[:0] for k, v in pick.items()}
    none_loss, none_metrics = case(logprobs[:0], entropy[:0], none)
    assert empty_loss.item() == 0.0 and none_loss.item() == 0.0
    combined = reduce_metrics([empty_metrics, metrics, none_metrics])
    for name, metric in metrics.items():
        assert combined[name].value.item() == pytest.approx(metric.value.item(), rel=1e-14), name


def test_optimizer_steps_report_the_mean_of_the_keys_they_have():
    """Two optimizer steps, ``b`` only in the first: ``a`` is (1 + 3) / 2, ``b`` its one value."""
    assert mean_over_steps([{"a": 1.0, "b": 2.0}, {"a": 3.0}]) == {"a": 2.0, "b": 2.0,
                                                                    "train/num_optimizer_steps": 2.0}
    assert mean_over_steps([{"x": 0.5}]) == {"x": 0.5, "train/num_optimizer_steps": 1.0}
