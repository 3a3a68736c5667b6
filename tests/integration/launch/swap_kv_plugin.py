"""Test plugin (``plugins:``): a q/k/v layout error that keeps every shape, in trainer ranks only.

Swaps ``k_proj`` and ``v_proj`` (both ``[num_key_value_heads * head_dim, hidden]``) in the Qwen3-MoE
mapping table's ``linear_qkv`` row, so the trainer's keys and values trade places with respect to
the engine's. Nothing fails on shapes or names; only the logprobs differ. Applied in processes that
hold a trainer rank (``RANK`` set by :class:`megarl.launch.trainer_group.TrainerWorker`) other than
the test's own (``MEGARL_TEST_DRIVER_PID``), whose tables later tests still use.
"""
import dataclasses
import os

from megarl.models.families import qwen3_moe

if "RANK" in os.environ and os.getpid() != int(os.environ.get("MEGARL_TEST_DRIVER_PID", "-1")):
    _KEY = qwen3_moe.MC + "self_attention.linear_qkv.weight"
    _q, _k, _v = qwen3_moe.TABLE[_KEY].hf
    if _k.endswith("k_proj.weight"):  # once per process (plugins are imported idempotently anyway)
        qwen3_moe.TABLE[_KEY] = dataclasses.replace(qwen3_moe.TABLE[_KEY], hf=(_q, _v, _k))
