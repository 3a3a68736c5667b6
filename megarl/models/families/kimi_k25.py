"""Kimi-K2.5 (``KimiK25ForConditionalGeneration``, model_type ``kimi_k25``): its text backbone.

Kimi-K2.5 is a vision-language model: a MoonViT vision tower (``vision_tower.*``), a projector
(``mm_projector.*``) and a DeepSeek-V3 language model (``language_model.*``), whose config is the
nested ``text_config`` (model_type ``deepseek_v3``; the release writes ``kimi_k2``, which
transformers' ``Kimi_K25Config.__post_init__`` reads as ``deepseek_v3``). megarl trains the text
backbone only: MLA with ``q_lora_rank``, ``first_k_dense_replace`` dense layers, 384 routed
experts with one shared expert, a sigmoid router with ``e_score_correction_bias`` (every rule and
refusal of :mod:`megarl.models.families.deepseek_v3` applies to ``text_config``).

Names. The release's checkpoint keeps the language model under ``language_model.``
(``language_model.model.layers.{L}.*``, ``language_model.model.embed_tokens.weight``,
``language_model.lm_head.weight``), which transformers 5 renames on load and back on save
(``transformers/conversion_mapping.py``, ``"kimi_k25"``) and SGLang 0.5.23 strips before
handing the tensors to its ``DeepseekV3ForCausalLM`` (``srt/models/kimi_k25.py``,
``KimiK25ForConditionalGeneration.load_weights``, lines 856-895). The table is DeepSeek-V3's with
that prefix on every HF name. The vision tower and projector are not part of the Megatron model:
they are not imported, and an export holds the text backbone only (the engine then keeps the
vision tower it was started with; see the family's tests).

Config. The architecture is read from ``text_config`` (:func:`text_config`); the top-level config's
own ``tie_word_embeddings`` is not what either runtime's language model reads for the output
layer (SGLang builds ``DeepseekV3ForCausalLM(config.text_config)``), so ``text_config``'s is used.
"""
from __future__ import annotations

from megarl.models.families import Family
from megarl.models.families import deepseek_v3 as v3
from megarl.models.table import Entry

PREFIX = "language_model."
"""Prefix of the text backbone's tensors in the Kimi-K2.5 checkpoint."""

TABLE = {name: Entry(tuple(PREFIX + hf for hf in entry.hf), entry.transform, entry.tp_split, entry.expert)
         for name, entry in v3.TABLE.items()}


def text_config(hf_config):
    """The DeepSeek-V3 ``text_config`` of a Kimi-K2.5 config (a ``PretrainedConfig`` or a dict).

    Raises:
        ValueError: the config has no ``text_config``.
    """
    text = hf_config.get("text_config") if isinstance(hf_config, dict) else getattr(hf_config, "text_config", None)
    if text is None:
        raise ValueError(f"HF config ({_model_type(hf_config)}) has no text_config: a Kimi-K2.5 config "
                         f"nests its language model's fields under text_config")
    return text


def _model_type(hf_config) -> str:
    return str(hf_config.get("model_type") if isinstance(hf_config, dict) else getattr(hf_config, "model_type", "?"))


def architecture(hf_config) -> dict:
    """Canonical architecture of the text backbone of a Kimi-K2.5 HF config (DeepSeek-V3's fields,
    read from ``text_config``).

    Raises:
        ValueError: no ``text_config``, or a setting DeepSeek-V3's rules refuse (names the field).
    """
    return v3.architecture(text_config(hf_config))


ENGINE_LOAD_GROUPS = tuple(tuple(PREFIX + name for name in group) for group in v3.ENGINE_LOAD_GROUPS)
"""DeepSeek-V3's groups under ``language_model.``: SGLang's ``KimiK25ForConditionalGeneration.load_weights``
passes one call's tensors, prefix stripped, to one ``DeepseekV3ForCausalLM.load_weights`` call
(``srt/models/kimi_k25.py`` lines 873-895), so its ``q_a_proj`` / ``kv_a_proj_with_mqa`` caching
(:data:`megarl.models.families.deepseek_v3.ENGINE_LOAD_GROUPS`) holds unchanged."""

TINY_VISION = dict(
    patch_size=14, num_attention_heads=2, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
    merge_kernel_size=[2, 2],
    # transformers' Kimi_K25VisionConfig spelling ...
    pos_emb_height=8, pos_emb_width=8, pos_emb_time=2,
    # ... and the release's (SGLang's KimiK25VisionConfig reads these, and vt_hidden_size in its projector)
    init_pos_emb_height=8, init_pos_emb_width=8, init_pos_emb_time=2, vt_hidden_size=32, mm_hidden_size=32)
"""A one-block vision tower: present so the tiny checkpoint has the release's layout; never run."""


def tiny_config(spec, common: dict):
    """The ``tiny:kimi_k25`` config and model class (:attr:`Family.tiny_config`): ``text_config`` is
    the ``tiny:deepseek_v3`` config (MLA with q/kv LoRA ranks, YaRN, grouped sigmoid router, one
    dense layer), with a one-block vision tower; ``architectures`` is the release's
    ``KimiK25ForConditionalGeneration`` (the name SGLang registers).

    ``language_model_only: true`` (a field SGLang 0.5.23 reads from the checkpoint,
    ``srt/configs/model_config.py`` line 674: then not multimodal, so no processor is loaded): SGLang
    builds Kimi-K2.5's image processor through transformers' ``AutoProcessor``, whose only
    ``kimi_k25`` image processor needs torchvision (``models/auto/image_processing_auto.py``
    mapping ``{"torchvision": "Kimi_K25ImageProcessor"}``), which the CPU install leaves out
    (``megarl/rollout/cpu_shims``: an import-only stand-in). The tiny model is served as text only;
    the vision tower is still built and loaded. Its own ``--language-model-only`` flag refuses this
    architecture (``server_args.py`` ``LANGUAGE_MODEL_ONLY_ARCHITECTURES``)."""
    from transformers import Kimi_K25Config

    text, _ = v3.tiny_config(spec, common)
    text_dict = text.to_dict()
    # as released: transformers reads kimi_k2 as deepseek_v3; SGLang's shared-expert rule reads architectures
    text_dict.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    cfg = Kimi_K25Config(  # type: ignore[call-arg]  # extra keys are kept as config attributes
        text_config=text_dict, vision_config={**TINY_VISION, "text_hidden_size": spec.hidden_size},
                         projection_hidden_size=int(TINY_VISION["hidden_size"]),  # type: ignore[call-overload]
                         tie_word_embeddings=spec.tie_word_embeddings, pad_token_id=common.get("pad_token_id"),
                         language_model_only=True)
    return cfg, _tiny_model_class()


RELEASE_NAMES = (("language_model.model.blocks.", "language_model.model.layers."),
                 ("model.mm_projector.pre_norm.", "mm_projector.pre_norm."),
                 ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."))
"""``(what transformers 5.19 writes, the release's name)``: its reverse of the ``"kimi_k25"``
conversion mapping applies the vision tower's ``blocks -> layers`` rename to every name (the text
layers come out as ``language_model.model.blocks.{L}``), has no rule for the projector's norm and
moves the patch embedding under ``encoder``; SGLang's loader wants the release's names
(``srt/models/kimi_k25.py`` lines 873-892: an unknown vision name raises "not found in params_dict";
text layers under another name would be dropped)."""


def _tiny_model_class():
    """transformers' ``Kimi_K25ForConditionalGeneration`` under the release's class name
    ``KimiK25ForConditionalGeneration`` (what ``save_pretrained`` writes as ``architectures``, and
    what SGLang's registry and :attr:`Family.engine_class` name), whose ``save_pretrained`` writes
    the release's tensor names (:data:`RELEASE_NAMES`)."""
    from transformers import Kimi_K25ForConditionalGeneration

    class KimiK25ForConditionalGeneration(Kimi_K25ForConditionalGeneration):
        def save_pretrained(self, save_directory, *args, **kwargs):
            super().save_pretrained(save_directory, *args, **kwargs)
            _rename_tensors(save_directory, RELEASE_NAMES)

    KimiK25ForConditionalGeneration.__module__ = Kimi_K25ForConditionalGeneration.__module__
    return KimiK25ForConditionalGeneration


def _rename_tensors(hf_dir, renames) -> None:
    """Rename, in ``hf_dir/model.safetensors`` (the tiny model's single file), every tensor whose
    name starts with an ``old`` of ``renames`` (``(old, new)`` prefixes)."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    def renamed(name):
        return next((new + name[len(old):] for old, new in renames if name.startswith(old)), name)

    path = Path(hf_dir) / "model.safetensors"
    save_file({renamed(k): v for k, v in load_file(path).items()}, path, metadata={"format": "pt"})


FAMILY = Family(name="kimi_k25", twin_engine_tp2=True,  # engine TP 2 at CPU scale (Family.twin_engine_tp2)
                model_types=("kimi_k25",), table=TABLE, architecture=architecture,
                text_config=text_config, hf_prefix=PREFIX,
                transformer_config_kwargs=v3.transformer_config_kwargs, gpt_model_kwargs=v3.gpt_model_kwargs,
                megatron_shapes=v3.megatron_shapes, engine_load_groups=ENGINE_LOAD_GROUPS,
                # Kimi-K2 / K2.5: <think>...</think>; <|tool_calls_section_begin|><|tool_call_begin|>
                # functions.name:0<|tool_call_argument_begin|>{json}<|tool_call_end|>...
                reasoning_parser="kimi_k2", tool_call_parser="kimi_k2",
                # srt/models/kimi_k25.py wraps srt/models/deepseek_v2.py's DeepseekV3ForCausalLM
                # (built from text_config), which shares embed_tokens when tied
                engine_class="sglang.srt.models.kimi_k25.KimiK25ForConditionalGeneration",
                engine_text_class="sglang.srt.models.deepseek_v2.DeepseekV3ForCausalLM",
                engine_unties_lm_head=False, tiny_config=tiny_config, tiny_random_norms=True)
