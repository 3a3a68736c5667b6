"""Former home of the local-rank runner, now :mod:`megarl.procs.local_ranks` (the checkpoint
converter uses it: production code, not a test helper). This name stays importable: it *is* that
module (same object, same attributes), so existing imports and monkeypatches keep working."""
import sys

from megarl.procs import local_ranks as _local_ranks

sys.modules[__name__] = _local_ranks
