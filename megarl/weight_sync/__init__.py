"""Weight sync, Megatron trainer -> SGLang engines: plan (pure metadata), transports, verification.

- :func:`~megarl.weight_sync.plan.build_plan`: who gathers / converts / buckets / receives what.
- :class:`~megarl.weight_sync.sync.WeightSynchronizer` / :func:`~megarl.weight_sync.build.build_weight_sync`:
  one sync (pause -> push -> flush -> weight_version -> continue) with the ``distributed``,
  ``shard``, ``tensor`` or ``disk`` transport.
- :mod:`~megarl.weight_sync.sglang_loader`: the engine-side loader of pre-sharded payloads.

Design notes, limits and measurements: ``megarl/weight_sync/README.md``.
"""
