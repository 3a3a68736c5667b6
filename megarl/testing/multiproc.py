"""The local-rank runner for tests and benchmarks: :func:`megarl.procs.local_ranks.run_ranks` with
the fork server preloading what megarl's rank functions import (:data:`RANK_PRELOAD`: the families'
HF config classes, the converters, Megatron's model builder), as the converter's ranks get it."""
from megarl.conversion.convert import RANK_PRELOAD
from megarl.procs import local_ranks


def run_ranks(fn, world_size: int, **kwargs):
    """:func:`megarl.procs.local_ranks.run_ranks` (same arguments, results and errors) with
    ``preload`` defaulting to :data:`RANK_PRELOAD`."""
    kwargs.setdefault("preload", RANK_PRELOAD)
    return local_ranks.run_ranks(fn, world_size, **kwargs)
