"""``load_proof.first_unwritten``: a received tensor counts as written only where it is, bit for
bit, a block of rows (or a run of a 1-D parameter) of a parameter of its module or its parent, in
the ways SGLang 0.5.23 fuses them (q/k/v rows of ``qkv_proj``, an expert's rows of ``w13_weight``,
a bias run of ``qkv_proj.bias``, columns padded past the tensor)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
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


def test_a_transformed_parameter_is_skipped_by_name_and_logged_once(caplog):
    """SGLang's DeepGEMM requant replaces ``weight_scale_inv`` by packed UE8M0 exponents and marks
    it ``format_ue8m0``: the checkpoint's fp32 scale is nowhere in it, which is not a missed load."""
    from megarl.weight_sync import load_proof

    model = _model()
    qkv = model.model.layers[0].self_attn.qkv_proj
    qkv.weight_scale_inv = torch.nn.Parameter(torch.zeros(2, 1, dtype=torch.int32), requires_grad=False)
    scale = (ATTN + "k_proj.weight_scale_inv", torch.full((1, 1), 2.5))  # fp32, as the trainer sends it
    named = _written(model) + [scale]
    assert first_unwritten(model, named) == len(named) - 1  # not marked: a missed load
    load_proof._PARAMS.clear()
    qkv.weight_scale_inv.format_ue8m0 = True
    load_proof.SKIPPED.discard(scale[0])
    with caplog.at_level("WARNING", logger=load_proof.__name__):
        assert first_unwritten(model, named) is None
        assert first_unwritten(model, named) is None
    warnings = [r.getMessage() for r in caplog.records if scale[0] in r.getMessage()]
    assert len(warnings) == 1 and "format_ue8m0" not in warnings[0] and "qkv_proj.weight_scale_inv" in warnings[0]


def test_a_transform_excuses_only_its_own_kind():
    """A marked scale does not excuse a weight of the same module that is nowhere, and a module
    SGLang stores transposed (``use_triton_kernels``) excuses its experts' matrices only."""
    from megarl.weight_sync import load_proof

    model = _model()
    qkv = model.model.layers[0].self_attn.qkv_proj
    qkv.weight_scale_inv = torch.nn.Parameter(torch.zeros(2, 1, dtype=torch.int32), requires_grad=False)
    qkv.weight_scale_inv.format_ue8m0 = True
    named = _written(model)
    named[1] = (named[1][0], named[1][1] + 1.0)  # k rows not loaded
    assert first_unwritten(model, named) == 1
    load_proof._PARAMS.clear()
    named = _written(model)
    named[5] = (named[5][0], torch.randn(3, 8))
    assert first_unwritten(model, named) == 5
    load_proof._PARAMS.clear()
    model.model.layers[0].mlp.experts.use_triton_kernels = True
    assert first_unwritten(model, named) is None
    marked = {ATTN + "qkv_proj.weight_scale_inv": "format_ue8m0", EXPERTS + "w13_weight": "use_triton_kernels"}
    assert load_proof.transformed_params(model) == {
        name: f"{name}: " + {**load_proof.PARAM_TRANSFORMS, **load_proof.MODULE_TRANSFORMS}[flag]
        for name, flag in marked.items()}


def test_the_switch_reaches_the_receiver(monkeypatch):
    """``weight_sync.load_proof`` -> TransportOptions -> the stage ticket's ``proof`` -> the receiver's
    ``_load``: with ``off`` a tensor that is nowhere is not reported; with ``every_sync`` it is."""
    from megarl.config.domains import DOMAINS
    from megarl.config.schema import WeightSyncConfig
    from megarl.weight_sync import receiver, sglang_loader
    from megarl.weight_sync.p2p import P2PTransport
    from megarl.weight_sync.transport import TransportOptions

    assert WeightSyncConfig().load_proof == "every_sync" and not DOMAINS["weight_sync.load_proof"].allows("on")
    plan = SimpleNamespace(engine_layout=SimpleNamespace(tp_size=1))  # what a transport reads at construction
    assert P2PTransport.from_options(plan, [], TransportOptions(load_proof=False)).load_proof is False
    assert P2PTransport.from_options(plan, [], TransportOptions()).load_proof is True
    monkeypatch.setattr(sglang_loader, "load_presharded", lambda model, named: None)  # the loader drops it
    model = _model()
    named = [(ATTN + "o_proj.weight", torch.randn(8, 8))]
    for proof, errors in ((False, []), (True, [(9, 0, 3)])):
        state = {"load_errors": [], "deferred": {"bucket": 3, "named": named, "whole": False, "proof": proof}}
        receiver._load_deferred(model, state)
        assert state["load_errors"] == errors


def test_verified_syncs_proves_exactly_the_verified_ones():
    """``verified_syncs``: the proof runs on the syncs ``weight_sync.verify`` checks (its own rule,
    ``verify_now``), ``every_sync`` on each, ``off`` on none; the choice reaches the rank's synchronizer."""
    from megarl.launch.trainer_group import TrainerWorker
    from megarl.launch.weight_sync_stage import load_proof_now, verify_now

    history = [dict(first_sync=True, changed=False, verified_changed=False),
               dict(first_sync=False, changed=True, verified_changed=False),
               dict(first_sync=False, changed=True, verified_changed=True)]
    verified = [verify_now("first", **h) for h in history]
    assert verified == [True, True, False]
    assert [load_proof_now("verified_syncs", v) for v in verified] == verified
    assert [load_proof_now("every_sync", v) for v in verified] == [True] * 3
    assert [load_proof_now("off", v) for v in verified] == [False] * 3
    with pytest.raises(ValueError, match="weight_sync.load_proof"):
        load_proof_now("sometimes", True)
    calls = []
    worker = SimpleNamespace(trainer=SimpleNamespace(named_parameters_for_sync=lambda: iter([("w", torch.zeros(1))])),
                             syncer=SimpleNamespace(sync=lambda params, version, **kw: calls.append((version, kw)) or {}))
    TrainerWorker.__ray_metadata__.modified_class.sync_weights(worker, 4, False)
    assert calls == [(4, {"load_proof": False})]


def test_minimax_m2_experts_and_head_split_norms_are_found_and_a_stale_one_named():
    """MiniMax-M2's names as SGLang 0.5.23 holds them on engine rank 1 of 2: ``block_sparse_moe.experts.E.w1/w3/w2``
    in ``block_sparse_moe.experts.w13_weight`` / ``w2_weight`` (``FusedMoE``: w1 rows then w3 rows) and
    ``self_attn.q_norm.weight`` holding rank 1's heads (``MiniMaxM2RMSNormTP``)."""
    torch.manual_seed(1)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    layer = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([layer])
    layer.self_attn = torch.nn.Module()
    layer.self_attn.q_norm = torch.nn.Module()
    layer.self_attn.q_norm.weight = torch.nn.Parameter(torch.randn(8))  # 2 of 4 heads of 4
    layer.block_sparse_moe = torch.nn.Module()
    experts = layer.block_sparse_moe.experts = torch.nn.Module()
    experts.w13_weight = torch.nn.Parameter(torch.randn(4, 6, 10))  # [E, 2 * I/tp, H]
    experts.w2_weight = torch.nn.Parameter(torch.randn(4, 10, 3))  # [E, H, I/tp]
    moe = "model.layers.0.block_sparse_moe.experts."
    named = [("model.layers.0.self_attn.q_norm.weight", layer.self_attn.q_norm.weight.data.clone()),
             (moe + "2.w1.weight", experts.w13_weight.data[2, :3].clone()),
             (moe + "2.w3.weight", experts.w13_weight.data[2, 3:].clone()),
             (moe + "1.w2.weight", experts.w2_weight.data[1].clone())]
    assert first_unwritten(model, named) is None
    named[2] = (named[2][0], named[2][1] + 1e-3)  # the engine still holds the old w3 rows of expert 2
    assert first_unwritten(model, named) == 2
