"""The Megatron-Core policy trainer (CPU over gloo, GPU with Transformer Engine and FP8).

Entry points: `megarl.training.trainer_build.build_trainer` (config -> `megarl.training.trainer.Trainer`
on this rank) and `megarl.training.batch.TrainBatch` (what the driver hands it).

Modules:

- ``batch``: `TrainBatch`, packed sequences of one RL step, from trajectories.
- ``batching``: data-parallel balancing, token-budget micro batches, packed rows, padding fraction.
- ``micro_batch``: a micro batch's tensors (rows, attention mask or THD params, index maps).
- ``logprobs``: vocab-parallel logprobs / entropy from ``[T, V/tp]`` logits.
- ``forward``: one micro batch through the model, the RL loss with global denominators, metrics.
- ``shard``: `BatchShard`, one data-parallel rank's part of an RL step (what the driver sends it).
- ``trainer``: `Trainer` (``prepare`` / ``train_prepared``, ``prepare_batch``, ``compute_logprobs``, ``train_step``,
  ``forward_backward``, ``named_parameters_for_sync``, checkpoints).
- ``trainer_build``: ``build_*`` steps from a `MegarlConfig`; ``optimizer``: DDP, optimizer, LR schedule.
- ``routing_replay``: MoE routing replay (R2 / R3) hooked into Megatron's ``TopKRouter``.
- ``checkpointing``: ``dist_checkpointing`` save / load at any layout; ``fp8``: FP8 settings.
- ``model``, ``parallel_state``, ``cpu_compat``, ``local_mla``: the model, parallel state and
  CPU compatibility (see their docstrings).
- ``local_attention``, ``local_gdn``, ``local_dsa``: local-spec core attention (fused SDPA per packed
  sequence), Qwen3.5's gated DeltaNet, DeepSeek-V3.2's sparse attention (DSA).
"""
