"""HF <-> Megatron-Core checkpoints: per-family mapping tables, streaming loading and conversion.

Public API (used by the trainer and the weight sync):

- :func:`load_hf_weights` (model chunks <- HF directory, per rank, tensor by tensor);
- :func:`megatron_to_hf` (full Megatron tensors -> HF checkpoint-style tensors, in memory),
  :func:`hf_names_for`, :func:`gather_tp` / :func:`split_tp`, :func:`global_expert_id`;
- :func:`get_family` and ``Family.layout(hf_config)`` -> :class:`ModelLayout`;
- ``megarl.checkpoint.convert``: ``hf_to_megatron`` / ``megatron_to_hf_dir`` (directory converters).
"""
from megarl.checkpoint.loader import load_hf_weights
from megarl.models.families import Family, get_family
from megarl.models.mapping import (
                                       Entry,
                                       ModelLayout,
                                       TPSplit,
                                       Transform,
                                       gather_tp,
                                       global_expert_id,
                                       global_name,
                                       hf_names_for,
                                       megatron_to_hf,
                                       split_tp,
)

__all__ = [
    "Entry", "Family", "ModelLayout", "TPSplit", "Transform", "gather_tp", "get_family",
    "global_expert_id", "global_name", "hf_names_for", "load_hf_weights",
    "megatron_to_hf", "split_tp",
]
