"""MoE routing replay: record the experts chosen per token and layer, and replay them later.

R2 (``train.routing_replay = "r2"``): the old-logprob pass records each router's top-k experts and
the training forward replays them, so the importance ratio compares the same expert paths.
R3 (``"r3"``, Rollout Routing Replay, Ma et al. 2025, arXiv:2510.11370): the rollout engine returns
its routes (``Trajectory.routed_experts``, packed into ``TrainBatch.routed_experts [T_total, L, K]``)
and the trainer replays those, so trainer and engine compute the same MoE function.

How it hooks Megatron-Core (0.16.1): ``TopKRouter.routing`` passes its ``router_replay`` attribute
to ``topk_routing_with_score_function``, which calls
``router_replay.get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)``
to choose the top-k. `RoutingReplay` puts one `_RouterSlot` in that attribute of every
``TopKRouter`` of the model (Megatron's own ``RouterReplay`` class keeps a process-global list of
instances; the slot keeps its state per router instead). A slot in replay mode returns the
replayed ids and ``scores.gather(1, ids)``, so the combine weights (softmax over the chosen
logits for Qwen3-MoE) stay differentiable: **router weights keep their gradients**; only the
discrete choice is fixed. Rows of ``-1`` (tokens without a recorded route, e.g. the prompt of an
R3 trajectory) fall back to the router's own top-k.

Token order: the router sees this rank's tokens of the packed row ``[1, T]`` in sequence order;
under sequence parallelism TP rank ``r`` sees rows ``[r T/tp, (r + 1) T/tp)``. Layer ``l`` (0-based,
global; the ``L`` axis of ``routed_experts``) is the router whose Megatron ``layer_number`` is
``l + 1``.

Activation recomputation (``model.recompute_granularity``): a checkpointed layer runs its router
twice per micro batch, once in the forward pass and again when the backward pass recomputes it.
Both must route alike, or the recomputed activations (and gradients) belong to other experts than
the forward's. A slot therefore keeps every target its forward calls used, in order, until `off`;
a router call that finds no fresh target while the autograd engine is running a backward pass is
a recomputation and takes the oldest kept target. Megatron's schedules run the backward passes of
a chunk's micro batches in the order of their forward passes, and every forward call of `RoutingReplay.replay`'s user
(`megarl.training.forward.run_model`) sets a fresh target first, so the queue pairs each
recomputation with its own forward. This holds for Megatron's own checkpoint and Transformer
Engine's (both re-run the layer in the backward pass).
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import torch
from torch import Tensor


class RoutingReplayError(ValueError):
    """Replay data is missing, misaligned or holds invalid expert ids."""


def validate_routed_experts(routed_experts: Tensor | None, *, num_layers: int, num_experts: int, topk: int,
                            cu_seqlens: Tensor | None = None) -> None:
    """Check replay routes before they reach a router.

    Args:
        routed_experts: ``[T_total, L, K]`` integer expert ids, ``-1`` rows = not recorded.
        num_layers: L, the model's number of layers.
        num_experts: E; valid ids are ``0 .. E - 1``.
        topk: K, the router's top-k.
        cu_seqlens: ``[B + 1]`` boundaries, only used to name the sequence in error messages.

    Raises:
        RoutingReplayError: when ``routed_experts`` is None, has the wrong ``[L, K]``, a row that
            mixes -1 with ids, an id outside ``[0, E)``, or a repeated id within a token's top-k.
    """
    if routed_experts is None:
        raise RoutingReplayError("routing replay is on but the batch has no routed_experts "
                                 "(R3: the engine must return routed experts; "
                                 "R2: let Trainer.prepare_batch record them)")
    if routed_experts.dim() != 3 or tuple(routed_experts.shape[1:]) != (num_layers, topk):
        raise RoutingReplayError(f"routed_experts must be [T, L={num_layers}, K={topk}], "
                                 f"got {tuple(routed_experts.shape)}")
    if routed_experts.is_floating_point():
        raise RoutingReplayError(f"routed_experts must hold integer ids, got {routed_experts.dtype}")
    unset = routed_experts < 0
    row_unset = unset.all(dim=-1)
    problems = [
        ("a row mixes -1 (unrecorded) with expert ids", unset.any(dim=-1) & ~row_unset),
        (f"an expert id is >= num_moe_experts={num_experts}", (routed_experts >= num_experts).any(dim=-1)),
        ("an expert id is < -1", (routed_experts < -1).any(dim=-1)),
    ]
    ids = routed_experts.sort(dim=-1).values
    duplicate = (ids[..., 1:] == ids[..., :-1]).any(dim=-1) & ~row_unset
    problems.append(("an expert id is repeated within a token's top-k", duplicate))
    for what, bad in problems:
        if bool(bad.any()):
            token, layer = (int(x) for x in bad.nonzero()[0])
            where = f"token {token}"
            if cu_seqlens is not None:
                seq = int(torch.searchsorted(cu_seqlens, torch.tensor(token), right=True)) - 1
                where += f" (sequence {seq}, position {token - int(cu_seqlens[seq])})"
            raise RoutingReplayError(f"routed_experts: {what} at {where}, layer {layer}: "
                                     f"{routed_experts[token, layer].tolist()}")


def _in_backward() -> bool:
    """Whether this thread is inside the autograd engine's backward pass (where checkpointed
    layers are recomputed, by reentrant and non-reentrant checkpointing alike). The graph-task id
    is what ``torch.utils.checkpoint`` itself reads; it is -1 outside a backward pass."""
    return torch._C._current_graph_task_id() != -1


class _RouterSlot:
    """Sits in ``TopKRouter.router_replay``; Megatron calls `get_replay_topk` for every routing."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.mode = "off"
        self.target: Tensor | None = None
        self.recorded: list[Tensor] = []
        self.used: collections.deque[Tensor] = collections.deque()
        """Targets of this step's forward calls, oldest first, for recomputations (module docstring)."""

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups: int | None = None, group_topk: int | None = None,
                        default_compute_topk: Callable[..., tuple[Tensor, Tensor]] | None = None,
                        ) -> tuple[Tensor, Tensor]:
        assert default_compute_topk is not None  # Megatron's router always passes it
        probs, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.mode == "record":
            self.recorded.append(indices.detach().clone())
        elif self.mode == "replay":
            target = self.target
            if target is not None:  # a forward call: its target is kept for the recomputation
                self.target = None  # one forward per set: a stale route must never be replayed silently
                self.used.append(target)
            elif self.used and _in_backward():  # the backward pass recomputes a micro batch
                target = self.used.popleft()
            if target is None or target.shape != indices.shape:
                raise RoutingReplayError(
                    f"layer {self.layer}: replay routes for {None if target is None else tuple(target.shape)} "
                    f"but the router sees {tuple(indices.shape)} (tokens x top-k); micro batch misaligned")
            # Routes are packed on the CPU; the router runs on its own device (CUDA): move them there.
            target = target.to(indices.device, indices.dtype)
            recorded = (target >= 0).all(dim=-1, keepdim=True)
            indices = torch.where(recorded, target, indices)
            probs = scores.gather(1, indices)  # differentiable: the router keeps its gradient
        return probs, indices


class RoutingReplay:
    """Record / replay hooks on every ``TopKRouter`` of a model (see the module docstring).

    Every method takes an optional ``chunk``: one of the model chunks given here (what Megatron's
    schedule passes to the forward step); it limits the call to that chunk's routers, which the
    interleaved pipeline schedule needs (it runs the chunks of a rank on different micro batches
    in turn). None = all routers of the rank.

    Args:
        model_chunks: the model chunks of this rank (Megatron modules, DDP-wrapped or not).

    Raises:
        RoutingReplayError: if the model has no ``TopKRouter`` or one lacks a ``layer_number``.
    """

    def __init__(self, model_chunks: Sequence[torch.nn.Module]) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.slots: dict[int, _RouterSlot] = {}
        self._chunk_layers: dict[int, list[int]] = {}
        for chunk in model_chunks:
            layers = self._chunk_layers.setdefault(id(chunk), [])
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    layer = getattr(module, "layer_number", None)
                    if layer is None:
                        raise RoutingReplayError("a TopKRouter has no layer_number; cannot map routes to layers")
                    slot = _RouterSlot(layer - 1)
                    module.router_replay = slot
                    self.slots[layer - 1] = slot
                    layers.append(layer - 1)
        if not self.slots:
            raise RoutingReplayError("routing replay needs an MoE model, but no TopKRouter was found")

    @property
    def layers(self) -> list[int]:
        """0-based global indices of the MoE layers on this rank."""
        return sorted(self.slots)

    def _slots(self, chunk: torch.nn.Module | None) -> dict[int, _RouterSlot]:
        if chunk is None:
            return self.slots
        if id(chunk) not in self._chunk_layers:
            raise RoutingReplayError("unknown model chunk: pass one of the chunks RoutingReplay was built with")
        return {layer: self.slots[layer] for layer in self._chunk_layers[id(chunk)]}

    def off(self, chunk: torch.nn.Module | None = None) -> None:
        """Route freely; forget targets and recordings."""
        for slot in self._slots(chunk).values():
            slot.mode, slot.target, slot.recorded = "off", None, []
            slot.used.clear()

    def record(self, chunk: torch.nn.Module | None = None) -> None:
        """Record every routing from now on (one ``[N, K]`` entry per router call)."""
        self.off(chunk)
        for slot in self._slots(chunk).values():
            slot.mode = "record"

    def take_recorded(self, chunk: torch.nn.Module | None = None) -> dict[int, Tensor]:
        """``{layer: [N, K] int64}`` ids of the single routing each router recorded, then clear.

        Raises:
            RoutingReplayError: if a router recorded no or several calls (one micro batch per take).
        """
        out = {}
        for layer, slot in self._slots(chunk).items():
            if len(slot.recorded) != 1:
                raise RoutingReplayError(f"layer {layer} recorded {len(slot.recorded)} routings, expected 1")
            out[layer] = slot.recorded.pop()
        return out

    def replay(self, routes: Tensor, chunk: torch.nn.Module | None = None) -> None:
        """Replay ``routes`` in the next forward of each router.

        Args:
            routes: ``[N, L, K]`` integer ids of the N tokens this rank's routers will see, for all
                L layers of the model (-1 rows route freely).
            chunk: only this chunk's routers (None: all).
        """
        for layer, slot in self._slots(chunk).items():
            if layer >= routes.shape[1]:
                raise RoutingReplayError(f"routes have {routes.shape[1]} layers, the model has MoE layer {layer}")
            slot.mode, slot.target, slot.recorded = "replay", routes[:, layer, :], []


def is_moe_layer(config, layer: int) -> bool:
    """Whether 0-based global layer ``layer`` has a router (Megatron's ``moe_layer_freq``: an int
    period or a per-layer 0/1 list)."""
    freq = getattr(config, "moe_layer_freq", 1)
    return bool(freq[layer]) if isinstance(freq, (list, tuple)) else layer % int(freq) == 0


def replay_routes(batch, config, num_layers: int, *, enabled: bool, required: bool = True) -> Tensor | None:
    """The batch's validated routes ``[T, L, K]`` when replay is ``enabled``, else None (also when not
    ``required`` and the batch has none: R2's recording pass routes freely).

    Rows of dense layers (no router: DeepSeek-V3's / GLM-4.5's first layers) are set to -1 in a copy
    first: SGLang's capture buffer leaves them zero-filled, which is no valid top-k.

    Args:
        batch: a :class:`~megarl.training.batch.TrainBatch` (``routed_experts``, ``cu_seqlens``).
        config: the Megatron ``TransformerConfig`` (``num_moe_experts``, ``moe_router_topk``,
            ``moe_layer_freq``).

    Raises:
        RoutingReplayError: see :func:`validate_routed_experts`.
    """
    if not enabled or (not required and batch.routed_experts is None):
        return None
    routes = batch.routed_experts
    dense = [layer for layer in range(num_layers) if not is_moe_layer(config, layer)]
    if dense and routes is not None and routes.dim() == 3 and routes.shape[1] == num_layers:
        routes = routes.clone()
        routes[:, dense] = -1
    validate_routed_experts(routes, num_layers=num_layers, num_experts=config.num_moe_experts,
                            topk=config.moe_router_topk, cu_seqlens=batch.cu_seqlens)
    return routes


def store_routes(buffer: Tensor, mb, taken: dict[int, Tensor], parallel) -> None:
    """Write one stage's recorded routes ``{layer: [N, K]}`` of micro-batch ``mb`` into ``buffer``
    (``[T, L, K]`` int32, the tokens of the batch ``mb`` was packed from: this rank's data-parallel
    shard, so each rank records its own rows) as expert ids + 1 (0 = none recorded). The caller sums
    the buffers of the ranks sharing the shard (TP / PP / CP) to complete it.

    With sequence parallelism each TP rank routed its own slice of tokens and writes it; otherwise
    every TP rank saw all tokens and only TP rank 0 writes. Padding positions are skipped.
    """
    p = parallel
    if not (p.sequence_parallel and p.tp_size > 1) and p.tp_rank != 0:
        return
    flat_to_token = torch.full((mb.flat_size,), -1, dtype=torch.int64)
    flat_to_token[mb.flat_index.cpu()] = mb.token_index.cpu()
    tokens = flat_to_token[mb.router_positions(tp_rank=p.tp_rank, tp_size=p.tp_size,
                                               sequence_parallel=p.sequence_parallel).cpu()]
    keep = tokens >= 0
    for layer, ids in taken.items():
        buffer[tokens[keep], layer] = ids.cpu()[keep].to(torch.int32) + 1
