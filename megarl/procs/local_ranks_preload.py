"""Imported once by the :mod:`megarl.procs.local_ranks` fork server, before the modules the caller
names in ``run_ranks(preload=...)``, so that rank processes start with torch, Megatron-Core and
torch.distributed.checkpoint already imported (each costs seconds; forked ranks share them)."""
from megarl.logging_setup import install as _filter_known_noise

_filter_known_noise()  # before Megatron's imports warn about TE/apex (megarl.logging_setup)

import torch  # noqa: E402
import torch.distributed  # noqa: E402
import torch.distributed.checkpoint  # noqa: E402, F401

try:
    import megatron.core
    import megatron.core.models.gpt
    import megatron.core.models.gpt.gpt_layer_specs  # each conversion rank needs it
    import megatron.core.pipeline_parallel  # noqa: F401
except ImportError:  # pragma: no cover - megatron-core is a hard dependency
    pass
