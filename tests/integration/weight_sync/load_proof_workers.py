"""Rank function of the load-proof test (module-level: ``run_ranks`` spawns it)."""
from __future__ import annotations

import workers


def sync_with_and_without_groups(rank: int, world_size: int, hf_dir: str, urls: list[str], probes,
                                 train_sequences, bucket_size_mb: float, split_groups: bool = True,
                                 engine_tp: int = 1, reset: bool = True) -> dict | None:
    """Train two steps; ``p2p`` sync with buckets of ``bucket_size_mb`` (every tensor its own
    bucket, the engine load groups kept whole) into engines of TP ``engine_tp`` and read the engines'
    probe logprobs; train one more step and sync again with the groups ignored
    (``model_specs.load_group`` answering None, as before issue 34), so every group's members travel
    in separate buckets. ``reset``: reload ``hf_dir`` into the engines at the end (a shared engine).

    Returns (rank 0): ``{"trainer", "engine", "buckets", "split_pairs", "split_stacks", "error"}``:
    trainer and engine logprobs after the first sync, its number of buckets, how many groups the second
    plan split (DeepSeek pairs, gpt-oss expert stacks), and the second sync's error (None if it
    passed); without ``split_groups`` only the first.
    """
    from megarl.config.schema import WeightSyncConfig
    from megarl.conversion.initial_weights import initial_weights
    from megarl.training.parallel_state import destroy_parallel
    from megarl.training.trainer_build import build_trainer
    from megarl.weight_sync import model_specs
    from megarl.weight_sync.manifest_checks import WeightSyncError
    from megarl.weight_sync.stacked_experts import stacked_specs
    from megarl.weight_sync.synchronizer_build import SyncSpec, build_weight_sync

    cfg = workers.make_cfg(hf_dir, {})
    trainer = build_trainer(cfg, load_weights=initial_weights(cfg.model))
    for step in range(2):
        trainer.train_step(trainer.prepare_batch(workers.packed(train_sequences, train=True, seed=step)))
    spec = SyncSpec(hf_dir=hf_dir, engine_urls=urls, engine_tp_size=engine_tp, dtype="float32", check_manifest=False)
    ws_cfg = WeightSyncConfig(transport="p2p", senders="segment", bucket_size_mb=bucket_size_mb)
    out: dict = {}
    try:
        syncer = build_weight_sync(spec, trainer.parallel, ws_cfg, parallel_cfg=cfg.parallel)
        try:
            syncer.sync(dict(trainer.named_parameters_for_sync()), policy_version=trainer.step)
        finally:
            syncer.close()
        out["trainer"] = workers.trainer_probe_logprobs(trainer, probes)
        out["engine"] = workers.engine_logprobs(urls, probes)[0]
        # tensors as the engine loads them (a gpt-oss expert stack is one, its slices one bucket)
        out["buckets"], out["tensors"] = len(syncer.plan.buckets), len(stacked_specs(list(syncer.plan.hf_tensors())))
        out["rank_bytes"] = syncer.plan.engine_shard_bytes()
        if not split_groups:
            return out if rank == 0 else None
        trainer.train_step(trainer.prepare_batch(workers.packed(train_sequences, train=True, seed=5)))
        grouped = model_specs.load_group
        model_specs.load_group = lambda *args, **kwargs: None
        try:
            split = build_weight_sync(spec, trainer.parallel, ws_cfg, parallel_cfg=cfg.parallel)
        finally:
            model_specs.load_group = grouped
        where = {t.name: b.index for b in split.plan.buckets for t in b.hf_tensors}
        out["split_pairs"] = sum(where[n] != where[n.replace("q_a_proj", "kv_a_proj_with_mqa")]
                                 for n in where if n.endswith("q_a_proj.weight"))
        stacks: dict = {}  # gpt-oss: buckets holding each expert stack's slices (name[E])
        for n, b in where.items():
            if n.endswith("]"):
                stacks.setdefault(n.rsplit("[", 1)[0], set()).add(b)
        out["split_stacks"] = sum(len(buckets) > 1 for buckets in stacks.values())
        try:
            split.sync(dict(trainer.named_parameters_for_sync()), policy_version=trainer.step)
            out["error"] = None
        except WeightSyncError as err:  # the engines stay paused in their update session: the caller ends it
            out["error"] = str(err)
            from megarl.weight_sync.engine_clients import EngineClients

            with EngineClients(urls) as engines:
                engines.call_all("end_weight_update")
                engines.call_all("resume")
        finally:
            split.close()
    finally:
        if rank == 0 and reset:
            workers.reset_engines(urls, hf_dir)  # leave the engine as it started
        destroy_parallel()
    return out if rank == 0 else None
