"""The algorithm functions on CUDA tensors give the CPU results (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from megarl.algorithms import POLICY_LOSSES, compute_advantages, compute_policy_loss, masked_is
from megarl.algorithms.aggregation import LossNormalizer

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_cuda_matches_cpu(name):
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 9, generator=gen, dtype=torch.float64) * 2
    rollout = old + 0.3 * torch.randn(6, 9, generator=gen, dtype=torch.float64)
    logprobs = old + 0.1 * torch.randn(6, 9, generator=gen, dtype=torch.float64)
    mask = torch.rand(6, 9, generator=gen) > 0.3
    mask[4] = False
    rewards = torch.randint(0, 2, (6,), generator=gen).to(torch.float64)
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    # The normalizer stays on the CPU, as after an all-reduce copied back to the host.
    normalizer = LossNormalizer.from_loss_mask(masked_is(old, rollout, mask).loss_mask, max_response_tokens=12)

    def run(device):
        lp = logprobs.to(device).requires_grad_()
        adv = compute_advantages("grpo", rewards.to(device), group_ids.to(device))
        correction = masked_is(old.to(device), rollout.to(device), mask.to(device))
        loss, metrics = compute_policy_loss(
            name, lp, old.to(device), adv, correction.loss_mask, is_weights=correction.weights,
            normalizer=normalizer, clip_low=0.05, clip_high=0.08,
        )
        loss.backward()
        return loss.detach().cpu(), lp.grad.cpu(), {k: m.value.cpu() for k, m in metrics.items()}

    cpu_loss, cpu_grad, cpu_metrics = run("cpu")
    gpu_loss, gpu_grad, gpu_metrics = run("cuda")
    assert torch.allclose(gpu_loss, cpu_loss, rtol=1e-10, atol=1e-12)
    assert torch.allclose(gpu_grad, cpu_grad, rtol=1e-10, atol=1e-12)
    for key, value in cpu_metrics.items():
        assert torch.allclose(gpu_metrics[key], value, rtol=1e-10, atol=1e-12), key
