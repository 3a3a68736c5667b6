"""``megarl validate`` refuses FP8 with the allgather MoE dispatcher exactly where Megatron-Core does.

megarl's FP8 settings (:func:`megarl.training.fp8.fp8_config`) pad every expert's routing map
(``moe_router_padding_for_fp8``) for an MoE model; Megatron-Core 0.16.1's ``TransformerConfig``
refuses that with the allgather dispatcher when the model is built, minutes into a GPU job. The
reference is Megatron's own check: a ``TransformerConfig`` built from those same fields (Transformer
Engine's version check, which needs CUDA, answered as a recent TE would answer it).
"""
from pathlib import Path

import pytest
from megatron.core.transformer import transformer_config as megatron_config

from megarl.config.loader import ConfigError, load_config
from megarl.config.validate import validate
from megarl.training.fp8 import fp8_config

REPO = Path(__file__).resolve().parents[3]
KEY = "model.moe_token_dispatcher_type"


def _cfg(tiny_moe_dir, fp8, dispatcher):
    data = REPO / "data" / "gsm8k"
    return load_config(REPO / "configs" / "base.yaml", [
        f"model.hf_path={tiny_moe_dir}", f"data.train_path={data / 'train.jsonl'}", "cluster.device=cuda",
        "train.precision=bf16", f"train.fp8={fp8}", "train.fp8_recipe=tensorwise",
        f"model.moe_token_dispatcher_type={dispatcher}"])


def _validation_issues(cfg) -> dict[str, str]:
    try:
        validate(cfg)
    except ConfigError as err:  # other checks may object to CUDA on this machine; only KEY matters
        return {issue.key: issue.message for issue in err.issues}
    return {}


def _megatron_refuses(cfg, monkeypatch) -> bool:
    extra = fp8_config(cfg.train, is_moe=True, cuda=True)
    monkeypatch.setattr(megatron_config, "is_te_min_version", lambda *args, **kwargs: True)
    try:
        megatron_config.TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=8,
                                          moe_router_topk=2, bf16=True,
                                          moe_token_dispatcher_type=cfg.model.moe_token_dispatcher_type, **extra)
    except ValueError as e:
        assert "dispatcher" in str(e), e
        return True
    return False


@pytest.mark.parametrize("fp8", ["null", "e4m3"])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_validate_refuses_the_pair_exactly_where_megatron_does(tiny_moe_dir, monkeypatch, fp8, dispatcher):
    cfg = _cfg(tiny_moe_dir, fp8, dispatcher)
    issues = _validation_issues(cfg)
    assert (KEY in issues) == _megatron_refuses(cfg, monkeypatch)
    if KEY in issues:
        assert "train.fp8" in issues[KEY] and KEY in issues[KEY]
