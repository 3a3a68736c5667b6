"""Deterministic sampling seeds, engine launch arguments, and splitting a step into optimizer steps."""
import asyncio

import pytest
import torch
from omegaconf import OmegaConf

from megarl.cluster.ray_engines import DETERMINISTIC_FLAG, SEEDING_SHIM_DIR, engine_kwargs, seeding_env
from megarl.config.schema import MegarlConfig
from megarl.launch.rollout_actor import SeededEngine
from megarl.training.batch import TrainBatch
from megarl.training.shard import mini_batches


class RecordingEngine:
    """Records the sampling params it receives (stands in for the network, not for SGLang's logic)."""

    def __init__(self):
        self.seen = []

    async def generate(self, input_ids, sampling_params, **kwargs):
        self.seen.append((tuple(input_ids), sampling_params["sampling_seed"]))
        return "out"

    async def pause(self, mode="retract"):
        return mode


def _seeds(seed, step, requests):
    engine = RecordingEngine()
    seeded = SeededEngine(engine, seed)
    seeded.start_step(step)

    async def run():
        await asyncio.gather(*(seeded.generate(ids, {"temperature": 1.0}) for ids in requests))
    asyncio.run(run())
    return engine.seen


def test_seeds_are_a_function_of_seed_step_and_request():
    group = [[1, 2, 3]] * 4 + [[1, 2, 4]]
    first = _seeds(7, 3, group)
    assert first == _seeds(7, 3, group)  # a resumed run re-draws the same seeds
    seeds = [s for _, s in first]
    assert len(set(seeds)) == 5  # the G identical first turns of a group get distinct seeds
    assert all(0 <= s < 2**63 for s in seeds)
    assert [s for _, s in _seeds(7, 4, group)] != seeds and [s for _, s in _seeds(8, 3, group)] != seeds
    # Other calls pass through; the caller's params are not modified.
    engine = RecordingEngine()
    params = {"temperature": 1.0}
    assert asyncio.run(SeededEngine(engine, 0).pause("abort")) == "abort"
    asyncio.run(SeededEngine(engine, 0).generate([1], params))
    assert params == {"temperature": 1.0}


def test_engine_kwargs_follow_the_config():
    cfg = OmegaConf.structured(MegarlConfig)
    cfg.rollout.engine.extra_args = ["--foo"]
    cfg.rollout.deterministic_sampling = True
    cfg.train.routing_replay = "r3"
    kw = engine_kwargs(cfg, device="cuda", log_path="/tmp/e.log", engine_id="engine0")
    assert kw["extra_args"] == ["--foo", DETERMINISTIC_FLAG] and kw["enable_return_routed_experts"]
    # On CPU the flag is refused by SGLang 0.5.23 (torch_native attention): the seeding shim is used.
    assert engine_kwargs(cfg, device="cpu", log_path=None, engine_id="e")["extra_args"] == ["--foo"]
    env = seeding_env(cfg, "cpu")
    assert env["MEGARL_SEEDED_SAMPLING"] == "1" and env["PYTHONPATH"].endswith(str(SEEDING_SHIM_DIR))
    assert seeding_env(cfg, "cuda") == {}
    assert kw["tp_size"] == cfg.rollout.engine.tensor_parallel_size and kw["engine_id"] == "engine0"


def test_mini_batches():
    """A step of 5 sequences at ``train.global_batch_size`` 2 is three optimizer steps over
    consecutive sequences; the selected mini batches put the whole batch back together."""
    lens = [3, 4, 2, 5, 3]
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()])
    mask = torch.ones(int(cu[-1]), dtype=torch.bool)
    mask[cu[:-1]] = False
    batch = TrainBatch(input_ids=torch.arange(int(cu[-1])), cu_seqlens=cu, loss_mask=mask,
                       advantages=torch.arange(5.0), rollout_logprobs=torch.zeros(int(cu[-1])),
                       old_logprobs=-torch.arange(float(cu[-1])))
    ranges = mini_batches(batch.num_sequences, 2)
    parts = [batch.select(r) for r in ranges]
    assert [p.num_sequences for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p.input_ids for p in parts]), batch.input_ids)
    assert torch.equal(torch.cat([p.old_logprobs for p in parts]), batch.old_logprobs)
    assert mini_batches(batch.num_sequences, 8) == [range(0, 5)]
    with pytest.raises(ValueError, match="global_batch_size"):
        mini_batches(5, 0)
