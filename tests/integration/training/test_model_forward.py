"""Megatron-Core GPTModel built from an HF config (2 gloo ranks) == transformers' forward.

Reference: ``AutoModelForCausalLM`` on the same directory, fp32, CPU. Logits are gathered over the
tensor-parallel group (vocabulary shards) and the pipeline's last stage; padded vocabulary rows are
dropped. Also checks that a checkpoint written by ``hf_to_megatron`` loads with Megatron's own
``dist_checkpointing.load`` at another layout, and the ParallelState values of each layout.
"""
import json
import shutil

import pytest
import torch

from megarl.testing.multiproc import run_ranks

TOL = 1e-4
SEQ, BATCH = 16, 2
CASES = [  # (model, tp, pp, ep, etp, weights)
    ("moe", 1, 1, 1, None, "hf"), ("moe", 2, 1, 1, None, "hf"), ("moe", 1, 1, 2, None, "hf"),
    ("moe", 2, 1, 2, 1, "hf"), ("moe", 1, 2, 1, None, "hf"), ("moe_no_norm_topk", 1, 1, 2, None, "hf"),
    ("dense", 1, 1, 1, None, "hf"), ("dense", 2, 1, 1, None, "hf"), ("dense", 1, 2, 1, None, "hf"),
    ("moe", 2, 1, 1, None, "dist"),
]


def _pipeline_forward(model, tokens, positions):
    """Forward through Megatron's pipeline schedule; the last stage returns the logits."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def step(data, chunk):
        out = chunk(*next(data), None)
        return out, lambda o: (o.float().sum() * 0, {"logits": o.detach()})

    with torch.no_grad():
        stored = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([(tokens, positions)]), model=[model],
            num_microbatches=1, seq_length=SEQ, micro_batch_size=BATCH, forward_only=True)
    return stored[0]["logits"] if stored else None


def _case(case, dirs, tokens):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mps

    from megarl.config.schema import ModelConfig, ParallelConfig
    from megarl.conversion.load_hf import load_hf_weights
    from megarl.training.model import build_model
    from megarl.training.parallel_state import destroy_parallel, initialize_parallel

    name, tp, pp, ep, etp, weights = case
    hf_dir = dirs[name]
    pcfg = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                          sequence_parallel=tp > 1)
    ps = initialize_parallel(pcfg, backend="gloo", seed=7)
    try:
        (model,) = build_model(hf_dir, pcfg, ModelConfig(), precision="fp32", device="cpu")
        if weights == "hf":
            load_hf_weights([model], hf_dir, ps)
        else:
            loaded = dist_checkpointing.load(model.sharded_state_dict(), dirs["moe_ckpt_tp1"])
            model.load_state_dict(loaded, strict=True)
        model.eval()
        positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
        if pp > 1:
            logits = _pipeline_forward(model, tokens, positions)
        else:
            with torch.no_grad():
                logits = model(tokens, positions, None)
        if logits is not None and tp > 1:
            shards = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(shards, logits.contiguous(), group=mps.get_tensor_model_parallel_group())
            logits = torch.cat(shards, dim=-1)
        state = {k: getattr(ps, k) for k in ("tp_rank", "tp_size", "pp_rank", "pp_size", "ep_rank",
                                             "ep_size", "etp_size", "dp_rank", "dp_size")}
        return logits, state
    finally:
        destroy_parallel()


def _worker(rank, world_size, dirs, tokens):
    return [_case(case, dirs, tokens) for case in CASES]


def _expected_state(rank, tp, pp, ep, etp):
    """Megatron's rank order tp-cp-ep-dp-pp for 2 ranks, written out."""
    tp_rank = rank % tp
    pp_rank = rank // (2 // pp) if pp > 1 else 0
    return {"tp_rank": tp_rank, "tp_size": tp, "pp_rank": pp_rank, "pp_size": pp,
            "ep_rank": rank % ep if ep > 1 else 0, "ep_size": ep, "etp_size": etp or tp,
            "dp_rank": rank if tp == pp == 1 else 0, "dp_size": 2 // (tp * pp)}


@pytest.mark.timeout(400)
def test_megatron_forward_matches_transformers(tiny_moe_dir, tiny_dense_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from megarl.conversion.convert import hf_to_megatron

    no_norm = tmp_path / "moe_no_norm_topk"
    shutil.copytree(tiny_moe_dir, no_norm)
    cfg = json.loads((no_norm / "config.json").read_text())
    (no_norm / "config.json").write_text(json.dumps({**cfg, "norm_topk_prob": False}))
    dirs = {"moe": str(tiny_moe_dir), "dense": str(tiny_dense_dir), "moe_no_norm_topk": str(no_norm),
            "moe_ckpt_tp1": str(hf_to_megatron(tiny_moe_dir, tmp_path / "ckpt_tp1"))}
    tokens = torch.randint(0, 2000, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    reference = {}
    for name in ("moe", "dense", "moe_no_norm_topk"):
        hf = AutoModelForCausalLM.from_pretrained(dirs[name], dtype=torch.float32).eval()
        with torch.no_grad():
            reference[name] = hf(tokens).logits
    assert (reference["moe"] - reference["moe_no_norm_topk"]).abs().max() > 100 * TOL  # the flag matters

    results = run_ranks(_worker, 2, args=(dirs, tokens), timeout_s=360)
    for rank, per_rank in enumerate(results):
        for case, (logits, state) in zip(CASES, per_rank):
            name, tp, pp, ep, etp, _ = case
            assert state == _expected_state(rank, tp, pp, ep, etp), (case, rank)
            if logits is None:
                assert pp > 1 and state["pp_rank"] == 0, case
                continue
            ref = reference[name]
            assert logits.shape[-1] >= ref.shape[-1] and logits.shape[:2] == ref.shape[:2]
            diff = (logits[..., : ref.shape[-1]] - ref).abs().max().item()
            assert diff <= TOL, (case, rank, diff)
