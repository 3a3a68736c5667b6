"""GSPO steps, routing replay (R2 and engine-given R3 routes) and checkpoint resume at another layout.

One spawned 2-rank gloo job (the stages share the expensive start-up):

1. TP2+SP with R2 routing replay: ``prepare_batch`` records every token's top-k; with identical old
   and new policy the first GSPO step's ratio is exactly 1; three steps on the fixed batch lower the
   loss and change the weights, the router's included (replay keeps router gradients); a router
   hook sees exactly the recorded experts in every training forward.
2. Engine-style (R3) routes that the router would not choose are replayed exactly (hook) and change
   the logprobs; corrupted or missing routes are rejected with a clear error.
3. Checkpoint saved at TP2, loaded at TP1 (DP2): the next step's loss and grad norm are identical.
   A KL penalty to the reference weights (host copies swapped in) runs throughout; an IcePop
   rollout correction masks exactly the tokens whose trainer/engine ratio leaves its band.
"""
import multiprocessing

import pytest
import torch
from megarl_trainer_cases import build, make_batch, make_cfg, teardown

from megarl.testing.multiproc import run_ranks

TP2 = {"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": True}
RL = {"train.routing_replay": "r2", "train.lr": 2e-4, "algorithm.clip_low": 0.2, "algorithm.clip_high": 0.2,
      "algorithm.kl_coef": 0.01}  # KL to the reference (the HF weights, kept on the host and swapped in)


def _hook_routers(trainer):
    """Record ``(layer, routing_map [N, E])`` of every router call."""
    from megatron.core.transformer.moe.router import TopKRouter

    calls = []
    for chunk in trainer.model_chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(lambda m, _, out: calls.append((m.layer_number - 1, out[1].clone())))
    return calls


def _check_replayed(trainer, batch, routes, calls):
    """Every router call routed each recorded token to exactly its recorded experts."""
    p = trainer.parallel
    mbs, _ = trainer.micro_batches(batch)
    layers = trainer.num_layers
    assert len(calls) == len(mbs) * layers, (len(calls), len(mbs))
    checked = 0
    for index, (layer, routing_map) in enumerate(calls):
        mb = mbs[index // layers]
        rows = mb.gather(routes, pad_value=-1)[mb.router_positions(
            tp_rank=p.tp_rank, tp_size=p.tp_size, sequence_parallel=p.sequence_parallel)]
        ids = rows[:, layer, :].long()
        recorded = (ids >= 0).all(-1)
        expected = torch.zeros_like(routing_map)
        expected[recorded] = expected[recorded].scatter(1, ids[recorded], True)
        assert torch.equal(routing_map[recorded], expected[recorded]), f"layer {layer}"
        checked += int(recorded.sum())
    assert checked > 0
    calls.clear()


def _stage_gspo_and_r2(trainer, batch):
    calls = _hook_routers(trainer)
    prepared = trainer.prepare_batch(batch)
    routes = prepared.routed_experts
    assert routes is not None and bool((routes >= 0).all()), "R2 recorded every token of every layer"
    calls.clear()
    before = {name: p.detach().clone() for name, p in trainer.named_parameters_for_sync()}
    steps = [trainer.train_step(prepared) for _ in range(3)]
    _check_replayed(trainer, prepared, routes, calls[:len(calls) // 3])  # first step's forward
    after = dict(trainer.named_parameters_for_sync())
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    ratios = [steps[0][f"loss/seq_importance_ratio_{k}"] for k in ("mean", "min", "max")]
    policy = trainer.compute_logprobs(prepared)
    reference = trainer.compute_logprobs(prepared, reference=True)
    return prepared, {"ratios": ratios, "losses": [m["loss/policy"] for m in steps],
                      "kl": [m["kl/ref_k3"] for m in steps], "ref_equals_prepared": torch.equal(reference, prepared.ref_logprobs),
                      "policy_restored": torch.equal(policy, trainer.compute_logprobs(prepared)),
                      "policy_moved": float((policy - reference).abs().max()),
                      "router_changed": any(".router." in n for n in changed), "num_changed": len(changed),
                      "num_params": len(before)}


def _stage_r3(trainer, batch):
    from megarl.training.routing_replay import RoutingReplayError

    calls = _hook_routers(trainer)
    num_experts, topk = trainer.config.num_moe_experts, trainer.config.moe_router_topk
    gen = torch.Generator().manual_seed(11)
    routes = torch.stack([torch.randperm(num_experts, generator=gen)[:topk]
                          for _ in range(batch.num_tokens * trainer.num_layers)])
    routes = routes.reshape(batch.num_tokens, trainer.num_layers, topk).to(torch.int32)
    routes[batch.cu_seqlens[0]:batch.cu_seqlens[0] + 2] = -1  # unrecorded rows route freely
    free = trainer.compute_logprobs(batch)
    calls.clear()
    replayed = trainer.compute_logprobs(batch.replace(routed_experts=routes))
    _check_replayed(trainer, batch, routes, calls)
    errors = []
    for corrupt in ("range", "duplicate"):
        bad = routes.clone()
        bad[5, 1] = torch.tensor([num_experts, 0]) if corrupt == "range" else torch.tensor([3, 3])
        try:
            trainer.train_step(batch.replace(routed_experts=bad, old_logprobs=free))
        except RoutingReplayError as err:
            errors.append(str(err))
    try:  # replay data misaligned with the batch (routes of another batch)
        trainer.train_step(batch.replace(old_logprobs=free, routed_experts=routes[:-3]))
    except ValueError as err:
        errors.append(str(err))
    trainer.cfg.train.routing_replay = "r3"  # R3: the engine's routes are required, none given
    try:
        trainer.compute_logprobs(batch)
    except RoutingReplayError as err:
        errors.append(str(err))
    trainer.cfg.train.routing_replay = "r2"
    return {"max_logprob_change": float((replayed - free).abs().max()), "errors": errors}


def _worker(rank, world_size, hf_dir, batch, ckpt_dir):
    multiprocessing.current_process().daemon = False  # dist_checkpointing's writers fork processes
    trainer = build(make_cfg(hf_dir, {**TP2, **RL}))
    prepared, out = _stage_gspo_and_r2(trainer, batch)
    out["r3"] = _stage_r3(trainer, batch)
    trainer.save_checkpoint(ckpt_dir)
    out["adam_steps_at_save"] = max(float(state["step"]) for inner in getattr(trainer.optimizer, "chained_optimizers",
                                                                             [trainer.optimizer])
                                    for state in inner.optimizer.state.values() if "step" in state)
    expected = [trainer.train_step(prepared) for _ in range(2)]
    teardown(trainer)
    trainer = build(make_cfg(hf_dir, RL))  # TP1: the two ranks are data parallel
    trainer.load_checkpoint(ckpt_dir)
    resumed = [trainer.train_step(prepared) for _ in range(2)]
    # the second step's loss follows from the first resumed update (Adam's bias correction included)
    out["resume"] = [[(m["loss/total"], m["optim/grad_norm"], m["optim/step"]) for m in run] for run in (expected, resumed)]
    out["adam_steps"] = sorted({float(state["step"]) for inner in getattr(trainer.optimizer, "chained_optimizers",
                                                                         [trainer.optimizer])
                                for state in inner.optimizer.state.values() if "step" in state})
    out["adam_steps_expected"] = float(out["adam_steps_at_save"] + 2)
    # IcePop drops tokens whose trainer/engine probability ratio leaves [0.5, 5]: engine logprobs equal
    # to the trainer's for sequences 0-2 (ratio 1, kept) and 0 (probability 1, ratio << 0.5) for the rest
    trainer.cfg.algorithm.rollout_correction = "icepop"
    engine = prepared.old_logprobs.clone()
    engine[int(prepared.cu_seqlens[3]):] = 0.0
    out["icepop"] = trainer.train_step(prepared.replace(rollout_logprobs=engine))["mismatch/is_masked_frac"]
    mask = prepared.loss_mask
    out["icepop_expected"] = float(mask[int(prepared.cu_seqlens[3]):].sum() / mask.sum())
    teardown(trainer)
    return out


@pytest.mark.timeout(600)
def test_gspo_replay_and_resume(tiny_moe_dir, tmp_path):
    from transformers import AutoConfig

    batch = make_batch(AutoConfig.from_pretrained(tiny_moe_dir).vocab_size, seed=5)
    out = run_ranks(_worker, 2, args=(str(tiny_moe_dir), batch, str(tmp_path / "ckpt")), timeout_s=540)[0]
    assert out["ratios"] == [1.0, 1.0, 1.0], "identical old and new policy: GSPO ratio exactly 1"
    losses = out["losses"]
    assert losses[0] > losses[1] > losses[2], losses
    assert out["router_changed"], "routing replay must keep router gradients"
    assert out["kl"][0] == pytest.approx(0.0, abs=1e-7) and out["kl"][2] > out["kl"][1] > 0, out["kl"]
    assert out["ref_equals_prepared"] and out["policy_restored"] and out["policy_moved"] > 1e-4
    assert out["icepop"] == pytest.approx(out["icepop_expected"], rel=1e-6)
    assert out["num_changed"] > out["num_params"] // 2
    assert out["r3"]["max_logprob_change"] > 1e-3, "replayed routes must change the computation"
    errors = out["r3"]["errors"]
    assert len(errors) == 4, errors
    assert "num_moe_experts" in errors[0] and "repeated" in errors[1] and "routed_experts has" in errors[2]
    assert "no routed_experts" in errors[3]
    for (loss, grad_norm, step), (resumed_loss, resumed_norm, resumed_step) in zip(*out["resume"], strict=True):
        assert resumed_step == step
        assert resumed_loss == pytest.approx(loss, rel=1e-5)
        assert resumed_norm == pytest.approx(grad_norm, rel=1e-4)
    # every parameter's Adam step (dense and expert optimizers alike) advanced once per optimizer step
    assert out["adam_steps"] == [out["adam_steps_expected"]], out["adam_steps"]
