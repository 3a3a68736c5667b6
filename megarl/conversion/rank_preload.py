"""Preloaded by the fork server of the converter's ranks (``run_ranks(preload=RANK_PRELOAD)`` in
:mod:`megarl.conversion.convert`, and the tests' ``megarl.testing.multiproc.run_ranks``): the HF
config classes of the supported model families, the converters and Megatron's model builder, so
that forked ranks share these imports (each costs seconds) instead of importing them each."""
try:
    from transformers import CONFIG_MAPPING

    from megarl.models.families import _registry

    for _model_type in {t for family in _registry().values() for t in family.model_types}:
        if _model_type in CONFIG_MAPPING:
            CONFIG_MAPPING[_model_type]  # imports the configuration module
    import megarl.conversion.convert
    import megarl.training.model  # noqa: F401
except Exception:  # noqa: BLE001 - preloading is an optimisation only
    pass
