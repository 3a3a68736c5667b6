"""Imported once by the :mod:`megarl.procs.local_ranks` fork server, so that rank processes start
with torch, Megatron-Core, torch.distributed.checkpoint and the HF config classes of the supported
model families already imported (each costs seconds; forked ranks share them)."""
from megarl.logging_setup import install as _filter_known_noise

_filter_known_noise()  # before Megatron's imports warn about TE/apex (megarl.logging_setup)

import torch  # noqa: F401, E402
import torch.distributed  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401

try:
    import megatron.core  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401  (each conversion rank needs it)
    import megatron.core.pipeline_parallel  # noqa: F401
except ImportError:  # pragma: no cover - megatron-core is a hard dependency
    pass

try:
    from transformers import CONFIG_MAPPING

    from megarl.models.families import _registry

    for _model_type in {t for family in _registry().values() for t in family.model_types}:
        if _model_type in CONFIG_MAPPING:
            CONFIG_MAPPING[_model_type]  # imports the configuration module
    import megarl.checkpoint.convert  # noqa: F401
    import megarl.training.model  # noqa: F401
except Exception:  # noqa: BLE001 - preloading is an optimisation only
    pass
