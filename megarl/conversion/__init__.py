"""HF <-> Megatron-Core checkpoints: streaming loading, directory conversion, distributed checkpoints.

The per-family mapping tables live in :mod:`megarl.models` (``families``, ``mapping``); this package
moves tensors between files and model chunks: :func:`megarl.conversion.load_hf.load_hf_weights`
(model chunks <- HF directory, per rank, tensor by tensor), ``megarl.conversion.convert``
(``hf_to_megatron`` / ``megatron_to_hf_dir`` directory converters) and the Megatron distributed
checkpoint formats (``dist_ckpt``, ``dist_convert``).
"""
