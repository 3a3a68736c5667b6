"""Former name of :mod:`megarl.procs.local_ranks_preload` (the same module object)."""
import sys

from megarl.procs import local_ranks_preload as _preload

sys.modules[__name__] = _preload
