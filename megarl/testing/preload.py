"""Former name of :mod:`megarl.launch.local_ranks_preload` (the same module object)."""
import sys

from megarl.launch import local_ranks_preload as _preload

sys.modules[__name__] = _preload
