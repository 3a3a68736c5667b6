"""Weight sync, Megatron trainer -> SGLang engines: plan (pure metadata), transports, verification.

- :func:`~megarl.weight_sync.plan.build_plan`: who gathers / converts / buckets / receives what.
- :class:`~megarl.weight_sync.sync.WeightSynchronizer` /
  :func:`~megarl.weight_sync.synchronizer_build.build_weight_sync`:
  one sync (pause -> push -> flush -> weight_version -> continue) with one of the transports of the
  registry :data:`megarl.config.sync_transports.TRANSPORTS` (``p2p``, ``distributed``, ``shard``,
  ``tensor``, ``disk``, or an import path), built by :func:`~megarl.weight_sync.choice.make_transport`.
- :mod:`~megarl.weight_sync.sglang_loader`: the engine-side loader of pre-sharded payloads.

Design and files: ``megarl/weight_sync/README.md``; measurements: ``tools/benchmarks/weight_sync.md``.
"""
