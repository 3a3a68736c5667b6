"""RolloutManager on the real SGLang CPU server: over-sampling, engine abort, partial rollouts
resumed after a weight update (``/update_weights_from_disk``), per-token policy versions."""
import time

import pytest
import torch

from megarl.config.schema import AgentConfig, RolloutConfig, SamplingConfig
from megarl.rollout.client import SGLangClient
from megarl.rollout.manager import RolloutManager
from megarl.rollout.types import RolloutStatus

LONG = 1000


class ShapingEngine:
    """The real client, with each "fast" prompt's turn shortened to 4 tokens and each "slow"
    one made to run its whole budget (``ignore_eos``). Only narrows what the agent asked for."""

    def __init__(self, client, tokenizer, prompt_len):
        self.client, self.tokenizer, self.prompt_len = client, tokenizer, prompt_len

    async def generate(self, input_ids, sampling_params, **kwargs):
        slow = "slow" in self.tokenizer.decode(input_ids[:self.prompt_len + 8])
        params = dict(sampling_params)
        if slow:
            params["ignore_eos"] = True
        else:
            params["max_new_tokens"] = min(4, params["max_new_tokens"])
        return await self.client.generate(input_ids, params, **kwargs)

    async def pause(self, mode="retract"):
        await self.client.pause(mode)

    async def resume(self):
        await self.client.resume()

    async def flush_cache(self):
        await self.client.flush_cache()


@pytest.mark.timeout(300)
async def test_over_sampling_abort_and_partial_rollout_resume(sglang_engine, tiny_moe_hf):
    model, tokenizer = tiny_moe_hf
    client = SGLangClient(sglang_engine.url)
    cfg = RolloutConfig(
        group_size=2, num_prompts_per_step=2, over_sample_prompts=2, partial_rollouts=True,
        tools={}, reward="gsm8k", reward_kwargs={"executor": "inline"},
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=LONG),
        agent=AgentConfig(max_turns=2, max_response_tokens=LONG + 100, max_context_tokens=4096))
    rows = [{"question": f"{kind} question {i}?", "answer": "7"}
            for i, kind in enumerate(["fast", "slow", "fast", "slow"])]
    probe = RolloutManager(client, tokenizer, cfg, filter_zero_variance=False)
    prompt_len = len(probe.ctx.template.prompt_ids(probe.messages_for(rows[0])))
    manager = RolloutManager(ShapingEngine(client, tokenizer, prompt_len), tokenizer, cfg,
                             filter_zero_variance=False)
    try:
        start = time.monotonic()
        first = await manager.generate_groups(iter(rows))
        first_s = time.monotonic() - start
        assert first_s < 30  # the slow groups were aborted, not waited for
        assert [g.group_id for g in first.groups] == [0, 2]  # the fast prompts
        assert first.metrics["rollout/groups_carried_over"] == 2

        # A weight update between steps: pause, load (same weights, new version), resume.
        await client.pause("abort")
        await client.update_weights_from_disk(sglang_engine.model_path, weight_version="1")
        await client.resume()
        manager.policy_version = 1
        second = await manager.generate_groups(iter([]))
    finally:
        await client.update_weights_from_disk(sglang_engine.model_path, weight_version="default")
        await client.close()

    assert sorted(g.group_id for g in second.groups) == [1, 3]
    assert second.metrics["rollout/groups_resumed"] == 2
    for traj in (t for g in second.groups for t in g.trajectories):
        # One turn, generated in two calls (aborted, then resumed), to its full budget.
        assert traj.status == RolloutStatus.TRUNCATED and traj.num_turns == 1
        assert traj.metadata["num_generate_calls"] == 2
        assert traj.metadata["finish_reasons"] == ["abort", "length"]
        assert traj.num_response_tokens == LONG and traj.loss_mask.all()
        versions = traj.token_policy_versions
        n_old = int((versions == 0).sum())
        assert 0 < n_old < LONG and versions[n_old:].eq(1).all() and traj.policy_version == 0
        # The continuation is the same policy's: engine logprobs == transformers on every token.
        ids = torch.cat([traj.prompt_ids, traj.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
        p = traj.prompt_ids.numel()
        ref = logp[torch.arange(p - 1, ids.numel() - 1), ids[p:]]
        assert (ref - traj.rollout_logprobs).abs().max().item() < 5e-3
