"""Colocated placement's engine-memory cycle (issue 18 item 8) against the real SGLang server.

The driver releases the engines' memory after a rollout and resumes it before the weight sync
(:mod:`megarl.cluster.colocated`). SGLang keeps the set of released tags and refuses a release while
busy, so the tag sequence must be exactly what its scheduler accepts; after the cycle and a weight
reload the engine generates exactly as before. (On CPU the memory saver is off, so the release
frees nothing; the endpoints, tags and ordering are the same code as on GPU.)
"""
import pytest

from megarl.cluster import colocated
from megarl.weight_sync.engine_clients import EngineClients

PROMPT = list(range(40, 90))
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}


@pytest.mark.timeout(300)
def test_release_train_resume_sync_cycle_keeps_the_engine_serving(sglang_engine, tiny_moe_dir):
    urls = [sglang_engine.url]
    with EngineClients(urls) as engines:
        before = engines.call_all("generate", PROMPT, GREEDY)[0]
        released = colocated.release(urls, weights=True)
        try:
            assert released == ("weights", "kv_cache", "cuda_graph")
        finally:
            colocated.resume(urls, released)
        # the weight sync rewrites the (uninitialised on GPU) weights
        engines.call_all("update_weights_from_disk", str(tiny_moe_dir))
        after = engines.call_all("generate", PROMPT, GREEDY)[0]
        # a step without a sync lends only the KV cache and CUDA graphs
        kept = colocated.release(urls, weights=False)
        colocated.resume(urls, kept)
        again = engines.call_all("generate", PROMPT, GREEDY)[0]
    assert kept == ("kv_cache", "cuda_graph")
    assert after.output_ids == before.output_ids == again.output_ids
