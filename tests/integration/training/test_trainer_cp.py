"""Context parallelism on CPU: every RL loss on 2 CP ranks = the same loss on the unsplit sequences.

Megatron-Core runs CP attention only through Transformer Engine (CUDA), so the model is replaced
by what CP changes around it: the full-row logits of each micro batch are a fixed parameter
``theta [S, V]`` (computed once); CP rank ``r`` gets ``theta`` at its positions (as the model would
output them) and goes through the trainer's CP path (`pack_cp_micro_batch`, the dispatch in
``forward.micro_batch_logprobs``, ``forward.rl_loss``), its loss scaled as
``Trainer.forward_backward`` and Megatron's schedule scale it (``x num_microbatches x dp_size``,
``x cp_size / num_microbatches``) and its gradient reduced as Megatron's DDP does (``/ (dp_size x
cp_size)``, sum over the data-parallel-with-CP group). Reference, on every rank: the unsplit
computation (the CP=1 path on the full row, built in this test; gradients simply summed over
micro batches). Loss values, metrics and summed gradients must agree for GSPO, GSPO-token and
PPO-clip in every aggregation mode, with a KL penalty and an entropy bonus.
"""
import pytest
import torch

from megarl.testing.multiproc import run_ranks

VOCAB, CP, TEMPERATURE = 11, 2, 0.7
LENGTHS = [7, 12, 5, 9, 16, 6]
MICRO_BATCHES = [(1, 0, 4), (3, 5, 2)]  # two micro batches, sequences in row order
PAD = 4  # extra trailing padding segment (multiple of 2 * CP) in the first micro batch

CASES = {
    **{f"gspo_{mode}": dict(policy_loss="gspo", loss_aggregation=mode)
       for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")},
    "gspo_token_seq_mean_token_mean": dict(policy_loss="gspo_token", loss_aggregation="seq_mean_token_mean"),
    "gspo_token_token_mean": dict(policy_loss="gspo_token", loss_aggregation="token_mean"),
    "ppo_token_mean_dual_clip": dict(policy_loss="ppo_clip", loss_aggregation="token_mean", clip_c=3.0),
    "ppo_seq_mean_token_sum": dict(policy_loss="ppo_clip", loss_aggregation="seq_mean_token_sum"),
    "gspo_kl_k3_entropy_bonus": dict(policy_loss="gspo", kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01),
    "ppo_kl_k1": dict(policy_loss="ppo_clip", loss_aggregation="token_mean", kl_coef=0.05, kl_estimator="k1"),
}


def _batch():
    from megarl.training.batch import TrainBatch

    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0] + LENGTHS).cumsum(0)
    total = int(cu[-1])
    mask = torch.rand(total, generator=gen) > 0.2
    mask[cu[:-1]] = False
    mask[cu[:-1] + 1] = False  # prompts of 2 tokens
    return TrainBatch(input_ids=torch.randint(0, VOCAB, (total,), generator=gen), cu_seqlens=cu, loss_mask=mask,
                      advantages=torch.randn(len(LENGTHS), generator=gen), rollout_logprobs=torch.zeros(total))


def _specs():
    from megarl.training.batching import MicroBatchSpec

    specs = []
    for j, rows in enumerate(MICRO_BATCHES):
        length = sum(-(-LENGTHS[i] // (2 * CP)) * 2 * CP for i in rows) + (PAD if j == 0 else 0)
        specs.append(MicroBatchSpec(rows=(rows,), row_length=length, num_tokens=sum(LENGTHS[i] for i in rows)))
    return specs


def _full_row_micro_batch(batch, spec):
    """The unsplit CP=1 micro batch of the same padded row (sequences at multiples of 2 * CP)."""
    from megarl.training.micro_batch import PackedMicroBatch

    ids = torch.zeros(spec.row_length, dtype=torch.int64)
    flat, tokens, lens, offset = [], [], [], 0
    for i in spec.rows[0]:
        start, end = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
        ids[offset:offset + end - start] = batch.input_ids[start:end]
        flat.append(torch.arange(offset, offset + end - start))
        tokens.append(torch.arange(start, end))
        lens.append(end - start)
        offset += -(-(end - start) // (2 * CP)) * 2 * CP
    cu = torch.tensor([0] + lens).cumsum(0)
    return PackedMicroBatch(spec=spec, input_ids=ids[None], position_ids=torch.arange(spec.row_length)[None],
                            attention_mask=None, packed_seq_params=None, cu_seqlens=cu,
                            flat_index=torch.cat(flat), token_index=torch.cat(tokens))


def _losses(theta, mbs, logits_of, inputs, algo, scale):
    """Run every micro batch's loss and backward (loss x ``scale``); return values and metrics."""
    from megarl.algorithms import reduce_metrics
    from megarl.training import forward as fwd

    total, metrics = 0.0, []
    for j, mb in enumerate(mbs):
        logprobs, entropy = fwd.micro_batch_logprobs(
            logits_of(theta[j], mb), mb, vocab_size=VOCAB, tp_group=None, temperature=TEMPERATURE,
            entropy="grad" if algo.entropy_coef > 0 else "metric")
        loss, mb_metrics = fwd.rl_loss(logprobs, entropy, mb, inputs=inputs, algo=algo)
        (loss * scale).backward()
        total += float(loss.detach())
        metrics.append(mb_metrics)
    return total, {name: float(m.value) for name, m in reduce_metrics(metrics).items()}


def _worker(rank, world_size):
    import torch.distributed as dist

    from megarl.config.schema import AlgorithmConfig
    from megarl.training import forward as fwd
    from megarl.training.context_parallel import pack_cp_micro_batch

    assert world_size == CP
    dp_size, batch, specs = 1, _batch(), _specs()
    full_mbs = [_full_row_micro_batch(batch, spec) for spec in specs]
    cp_mbs = [pack_cp_micro_batch(batch, spec, cp_rank=rank, cp_size=CP) for spec in specs]
    gen = torch.Generator().manual_seed(1)
    theta0 = [torch.randn(spec.row_length, VOCAB, generator=gen) * 2 for spec in specs]
    # old / reference logprobs near the current ones, from the unsplit path (same on both ranks)
    current = torch.zeros(batch.num_tokens)
    with torch.no_grad():
        for t, mb in zip(theta0, full_mbs):
            current[mb.token_index] = fwd.micro_batch_logprobs(t[None], mb, vocab_size=VOCAB, tp_group=None,
                                                               temperature=TEMPERATURE, entropy="none")[0]
    noise = torch.randn(2, batch.num_tokens, generator=gen) * 0.3
    batch = batch.replace(old_logprobs=current + noise[0], ref_logprobs=current + noise[1])
    results = {}
    for name, fields in CASES.items():
        algo = AlgorithmConfig(clip_low=0.2, clip_high=0.3, **fields)
        inputs, _ = fwd.loss_inputs(batch, algo, device="cpu", max_response_tokens=16)
        ref_theta = [t.clone().requires_grad_() for t in theta0]
        ref_loss, ref_metrics = _losses(ref_theta, full_mbs, lambda t, mb: t[None], inputs, algo, 1.0)
        cp_theta = [t.clone().requires_grad_() for t in theta0]
        num_mbs = len(cp_mbs)  # Trainer.forward_backward's factor, then Megatron's 2-tuple loss_func scaling
        scale = (num_mbs * dp_size) * CP / num_mbs
        cp_loss, cp_metrics = _losses(cp_theta, cp_mbs, lambda t, mb: t[mb.local_index][None], inputs, algo, scale)
        grads = torch.cat([t.grad.reshape(-1) for t in cp_theta]) / (dp_size * CP)  # DDP pre-scaling
        dist.all_reduce(grads)  # DDP sum over the data-parallel-with-CP group
        results[name] = dict(ref_loss=ref_loss, cp_loss=cp_loss, ref_metrics=ref_metrics, cp_metrics=cp_metrics,
                             ref_grad=torch.cat([t.grad.reshape(-1) for t in ref_theta]), cp_grad=grads)
    return results


def _cpu_refusal_worker(rank, world_size, hf_dir):
    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.training.model import build_model
    from megarl.training.parallel_state import destroy_parallel, initialize_parallel

    parallel_cfg = ParallelConfig(context_parallel_size=2)
    initialize_parallel(parallel_cfg, backend="gloo")
    try:
        build_model(hf_dir, parallel_cfg, ModelConfig(), device="cpu")
    except ValueError as err:
        return str(err)
    finally:
        destroy_parallel()
    return None


@pytest.mark.timeout(240)
def test_every_loss_on_two_cp_ranks_matches_the_unsplit_loss():
    results = run_ranks(_worker, CP, timeout_s=200)
    for name in CASES:
        for rank in range(CP):
            r = results[rank][name]
            assert r["cp_loss"] == pytest.approx(r["ref_loss"], rel=1e-5, abs=1e-7), (name, rank)
            assert r["cp_metrics"].keys() == r["ref_metrics"].keys(), name
            for key, value in r["ref_metrics"].items():
                assert r["cp_metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)
            assert r["ref_grad"].abs().max() > 1e-3, name  # the check is not vacuous
            torch.testing.assert_close(r["cp_grad"], r["ref_grad"], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.timeout(120)
def test_cp_without_transformer_engine_is_refused_with_the_field_name(tiny_moe_dir):
    messages = run_ranks(_cpu_refusal_worker, 2, args=(str(tiny_moe_dir),), timeout_s=100)
    for message in messages:
        assert message is not None and "parallel.context_parallel_size=2" in message
        assert "Transformer Engine" in message
