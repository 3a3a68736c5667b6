"""Peak CPU memory of a piece of work, from torch's own allocator events (tests and benchmarks)."""
from __future__ import annotations

from collections.abc import Callable


def peak_cpu_bytes(fn: Callable[[], object]) -> int:
    """Peak of the CPU bytes ``fn()`` holds beyond what was live before it (bytes).

    The running sum of torch's CPU allocations and frees while ``fn`` runs, read from
    ``torch.profiler``'s ``[memory]`` events in time order: activations, logits, gradients and
    temporaries, not the tensors that already existed (weights, optimizer state). The profiler
    slows ``fn``: do not time the same call.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak
