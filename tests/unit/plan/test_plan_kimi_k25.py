"""Kimi-K2.5's model on paper (configs/models/kimi-k2.5/config.json; provenance in that folder's
README): the family reads its nested ``text_config``, and the planner's parameter count equals
transformers' own text backbone of that config (built on the meta device)."""
from pathlib import Path

import pytest
import torch

from megarl.plan.shape import ModelShape

REPO = Path(__file__).resolve().parents[3]
MODEL = REPO / "configs" / "models" / "kimi-k2.5"


@pytest.mark.timeout(60)
def test_the_family_reads_the_text_backbone():
    from transformers import AutoConfig

    from megarl.models.families import get_family

    hf = AutoConfig.from_pretrained(MODEL)
    family = get_family(hf)
    arch = family.architecture(hf)
    assert family.name == "kimi_k25" and hf.model_type == "kimi_k25"
    assert (arch["num_hidden_layers"], arch["num_experts"], arch["n_shared_experts"], arch["first_k_dense_replace"],
            arch["q_lora_rank"], arch["kv_lora_rank"]) == (61, 384, 1, 1, 1536, 512)
    with pytest.raises(ValueError, match="text_config"):
        family.architecture({"model_type": "kimi_k25"})


@pytest.mark.slow  # transformers' meta model of a 1T-parameter backbone
@pytest.mark.timeout(300)
def test_total_parameters_match_transformers_text_backbone():
    from transformers import AutoConfig, AutoModel

    hf = AutoConfig.from_pretrained(MODEL)
    with torch.device("meta"):
        backbone = AutoModel.from_config(hf.text_config)  # what Kimi_K25Model builds as its language_model
    reference = sum(p.numel() for p in backbone.parameters()) + hf.text_config.vocab_size * hf.text_config.hidden_size
    ours = ModelShape.from_hf_config(hf)  # + lm_head (untied)
    assert ours.num_experts == 384 and ours.mla and not ours.tie_embeddings
    assert abs(ours.total_params() / reference - 1) < 0.001, (ours.total_params(), reference)


@pytest.mark.timeout(120)
def test_weight_sync_specs_are_kimi_k2s_under_language_model():
    """Kimi-K2.5's sync plan is its text backbone's, Kimi-K2's (configs/models/kimi-k2-like, the same
    DeepSeek-V3 architecture), every HF name under ``language_model.``, the same shapes, dtypes,
    engine splits (the vocabulary-parallel embedding and lm_head included) and load groups."""
    import dataclasses
    import json

    from megarl.weight_sync.model_specs import param_specs_from_hf_config
    from megarl.weight_sync.specs import EngineSplit

    k25 = json.loads((MODEL / "config.json").read_text())
    k2 = json.loads((REPO / "configs" / "models" / "kimi-k2-like" / "config.json").read_text())
    k25["text_config"]["num_hidden_layers"] = k2["num_hidden_layers"] = 3  # dense, MoE, MoE
    ours, ref = (param_specs_from_hf_config(c, tensor_model_parallel_size=2) for c in (k25, k2))

    def prefixed(spec):
        hf = tuple(dataclasses.replace(h, name="language_model." + h.name) for h in spec.hf)
        group = spec.load_group and "language_model." + spec.load_group
        return dataclasses.replace(spec, hf=hf, load_group=group)

    assert ours == [prefixed(s) for s in ref]
    splits = {h.name: h.engine_split for s in ours for h in s.hf}
    assert splits["language_model.model.embed_tokens.weight"] is EngineSplit.VOCAB
    assert splits["language_model.lm_head.weight"] is EngineSplit.VOCAB
    assert sum(s.load_group is not None for s in ours) == 2 * 3  # q_a_proj + kv_a_proj_with_mqa per layer
