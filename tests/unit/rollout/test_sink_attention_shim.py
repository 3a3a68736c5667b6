"""The gpt-oss attention of ``megarl/rollout/cpu_shims/sglang_sink_attention.py`` equals transformers'.

Reference: transformers' own eager gpt-oss attention inside a real ``GptOssForCausalLM`` forward (its
``eager_attention_forward`` is wrapped to record the query, key, value it was given, its own
sliding-window / causal mask and its output). The shim must reproduce each layer's output from the
query, key, value, sinks and window alone, for a whole prefill and for the last rows with a
position offset (a decode step or a prefill over a cached prefix). The end-to-end proof through
the real SGLang server is ``tests/integration/rollout/test_engine_gpt_oss_cpu.py``.
"""
from __future__ import annotations

import pytest
import torch

from megarl.rollout.cpu_shims.sglang_sink_attention import sink_attention

pytestmark = pytest.mark.timeout(120)  # one tiny transformers forward; the import dominates

SEQ = 13
WINDOW = 4
TOL = 1e-6


@pytest.fixture(scope="module")
def recorded():
    """Per layer: (attention module, query [Hq, L, D], key, value [Hkv, L, D], output [Hq, L, D])."""
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.models.gpt_oss import modeling_gpt_oss

    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=WINDOW,
                       layer_types=["sliding_attention", "full_attention"],
                       attn_implementation="eager")
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)  # large enough that a dropped sink shows
    calls = []
    original = modeling_gpt_oss.eager_attention_forward

    def record(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        out, weights = original(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        calls.append((module, query[0], key[0], value[0], out[0].transpose(0, 1), scaling))
        return out, weights

    modeling_gpt_oss.eager_attention_forward = record
    try:
        with torch.no_grad():
            model(torch.randint(0, cfg.vocab_size, (1, SEQ)))
    finally:
        modeling_gpt_oss.eager_attention_forward = original
    assert [c[0].sliding_window for c in calls] == [WINDOW, None]
    return calls


def _window(module) -> int:
    """SGLang's ``sliding_window_size`` for this layer (gpt-oss: HF's window - 1, or -1)."""
    return module.sliding_window - 1 if module.sliding_window else -1


@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
def test_prefill_equals_transformers_eager(recorded, layer):
    module, q, k, v, ref, scaling = recorded[layer]
    got = sink_attention(q, k, v, module.sinks, scaling, _window(module))
    assert (got - ref).abs().max().item() < TOL


@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
@pytest.mark.parametrize("rows", [1, 5])
def test_offset_rows_equal_transformers_eager(recorded, layer, rows):
    # The last `rows` queries over all keys: a decode step (1) or an extend over a cached prefix (5).
    module, q, k, v, ref, scaling = recorded[layer]
    got = sink_attention(q[:, -rows:], k, v, module.sinks, scaling, _window(module), query_offset=SEQ - rows)
    assert (got - ref[:, -rows:]).abs().max().item() < TOL


def test_the_comparison_sees_sinks_and_window(recorded):
    # The same check fails without the sinks, or with the sliding layer's window ignored.
    module, q, k, v, ref, scaling = recorded[0]
    no_sink = sink_attention(q, k, v, torch.full_like(module.sinks, float("-inf")), scaling, _window(module))
    no_window = sink_attention(q, k, v, module.sinks, scaling, -1)
    off_by_one = sink_attention(q, k, v, module.sinks, scaling, WINDOW)
    for wrong in (no_sink, no_window, off_by_one):
        assert (wrong - ref).abs().max().item() > 1e-3


def test_bad_shapes_are_refused():
    q, k = torch.zeros(3, 2, 4), torch.zeros(2, 2, 4)
    with pytest.raises(ValueError, match="query heads 3, kv heads 2"):
        sink_attention(q, k, k, torch.zeros(3), 0.5)
    with pytest.raises(ValueError, match="sinks"):
        sink_attention(torch.zeros(4, 2, 4), k, k, torch.zeros(3), 0.5)
