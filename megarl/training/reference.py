"""The reference policy's weights (the KL term's ``pi_ref``): a host copy of the initial parameters,
swapped into the model for a reference forward and swapped back afterwards."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor


def snapshot(model_chunks: list) -> list[Tensor]:
    """Detached host copies of every parameter of the chunks, in ``parameters()`` order."""
    return [param.detach().to("cpu", copy=True) for chunk in model_chunks for param in chunk.parameters()]


@torch.no_grad()
def restore(model_chunks: list, weights: list[Tensor]) -> None:
    """Copy ``weights`` (from :func:`snapshot`) back into the chunks' parameters, in place."""
    params = [param for chunk in model_chunks for param in chunk.parameters()]
    for param, value in zip(params, weights, strict=True):
        param.copy_(value, non_blocking=True)


@contextlib.contextmanager
def reference_weights(model_chunks: list, weights: list[Tensor] | None) -> Iterator[None]:
    """Run the body with ``weights`` copied into the model, the policy's restored afterwards (also on
    error); ``None`` runs it on the policy's own weights."""
    if weights is None:
        yield
        return
    from megarl.training.optimizer import gather_params

    # A pending overlap_param_gather would write the policy over the reference weights in the
    # forward's pre-hooks (and the snapshot would hold stale shards): finish it first.
    gather_params(model_chunks)
    policy = snapshot(model_chunks)
    restore(model_chunks, weights)
    try:
        yield
    finally:
        restore(model_chunks, policy)
