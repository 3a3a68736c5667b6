"""``load_proof.first_unwritten``: a received tensor counts as written only where it is, bit for
bit, a block of rows (or a run of a 1-D parameter) of a parameter of its module or its parent, in
the ways SGLang 0.5.23 fuses them (q/k/v rows of ``qkv_proj``, an expert's rows of ``w13_weight``,
a bias run of ``qkv_proj.bias``, columns padded past the tensor)."""
from __future__ import annotations

import torch

from megarl.weight_sync.load_proof import first_unwritten

ATTN = "model.layers.0.self_attn."
EXPERTS = "model.layers.0.mlp.experts."


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    layer = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([layer])
    layer.self_attn = torch.nn.Module()
    layer.self_attn.qkv_proj = torch.nn.Linear(8, 16)  # q 8 rows, k 4, v 4
    layer.self_attn.o_proj = torch.nn.Linear(8, 8, bias=False)
    layer.mlp = torch.nn.Module()
    layer.mlp.experts = torch.nn.Module()
    layer.mlp.experts.w13_weight = torch.nn.Parameter(torch.randn(4, 6, 10))  # 2 columns of padding
    return model


def _written(model) -> list:
    attn, experts = model.model.layers[0].self_attn, model.model.layers[0].mlp.experts
    w, b = attn.qkv_proj.weight.data, attn.qkv_proj.bias.data
    return [(ATTN + "q_proj.weight", w[:8].clone()), (ATTN + "k_proj.weight", w[8:12].clone()),
            (ATTN + "v_proj.weight", w[12:].clone()), (ATTN + "k_proj.bias", b[8:12].clone()),
            (ATTN + "o_proj.weight", attn.o_proj.weight.data.clone()),
            (EXPERTS + "2.up_proj.weight", experts.w13_weight.data[2, 3:, :8].clone())]


def test_every_written_tensor_is_found():
    model = _model()
    assert first_unwritten(model, _written(model)) is None


def test_a_tensor_the_loader_left_out_is_named_by_index():
    model = _model()
    named = _written(model)
    with torch.no_grad():  # the engine still holds the old k rows, the trainer sent new ones
        named[1] = (named[1][0], named[1][1] + 1e-6)
    assert first_unwritten(model, named) == 1
    named = _written(model)
    named[5] = (named[5][0], torch.randn(3, 8))  # an expert matrix that is nowhere
    assert first_unwritten(model, named) == 5


def test_one_changed_bit_is_not_written():
    model = _model()
    named = _written(model)
    stale = named[4][1].clone()
    stale.view(torch.int32)[3, 5] ^= 1
    named[4] = (named[4][0], stale)
    assert first_unwritten(model, named) == 4
