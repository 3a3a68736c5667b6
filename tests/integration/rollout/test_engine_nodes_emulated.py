"""One SGLang engine (TP 2) across two emulated hosts on the CPU backend (issue 25 part 4).

Each host is a network namespace with its own address (:mod:`megarl.testing.netns`); each runs one
node part exactly as megarl builds it (:class:`~megarl.rollout.engine_process.EngineProcess` with
``nnodes=2``, ``node_rank``, ``dist_init_addr`` = node 0's address; ``SGLANG_HOST_IP`` = the host's
address, as :class:`~megarl.rollout.engine_actor.EngineActor` sets it). Each part also gets its own
``/dev/shm`` (a private mount namespace): network namespaces share the machine's, and SGLang decides
"same node" by opening a shared-memory segment (``parallel_state.in_the_same_node_as``), so without
it node 1 took node 0 for itself and waited on its own loopback for the broadcast queue — real
hosts never share ``/dev/shm``.

References: node-rank 1 serves no API (SGLang's dummy server answers ``/health`` only; the API is
node 0's), and the logprobs node 0 returns for its greedy tokens equal a Hugging Face forward pass
of the same weights on the same tokens (float32; the TP2 reduction order may differ: 1e-3).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

PORT, RENDEZVOUS_PORT = 30000, 29500
HEALTHY_S = 1200
"""Both parts up: the whole test took 473 s at load average ~30 on the shared 2-core machine."""
PROMPT = [1, 2, 3, 4, 5, 6]
NEW_TOKENS = 6

HTTP = r"""
import json, sys, urllib.request, urllib.error
url, body = sys.argv[1], sys.argv[2]
req = urllib.request.Request(url, data=body.encode() if body else None, headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=60) as r:
        print(json.dumps({"status": r.status, "body": r.read().decode()}))
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "body": ""}))
except OSError as e:
    print(json.dumps({"status": 0, "body": str(e)}))
"""


def _http(host, url: str, body: dict | None = None) -> dict:
    """GET (or POST ``body``) ``url`` from inside emulated ``host``: ``{"status", "body"}``."""
    out = host.run([sys.executable, "-c", HTTP, url, json.dumps(body) if body else ""], capture_output=True,
                   text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _private_shm(argv: list[str]) -> list[str]:
    """``argv`` in a new mount namespace with its own ``/dev/shm`` (see the module docstring)."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs -o size=2g tmpfs /dev/shm && exec "$@"', "sh", *argv]


def _hf_logprobs(model_dir, ids: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(len(PROMPT), len(ids))]


@pytest.mark.slow
@pytest.mark.timeout(HEALTHY_S + 300)
def test_tp2_engine_across_two_emulated_hosts_serves_from_node_rank_0(tiny_dense_dir, tmp_path):
    from megarl.rollout.engine_process import EngineProcess
    from megarl.testing.netns import emulated_hosts, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with emulated_hosts(["node0", "node1"], prefix=f"en{tmp_path.name[-6:]}") as hosts:
        head = hosts["node0"]
        parts = [EngineProcess(tiny_dense_dir, host=h.addr, port=PORT, tp_size=2, device="cpu", dtype="float32",
                               mem_fraction_static=0.1, max_total_tokens=2048, grammar_backend="none",
                               nnodes=2, node_rank=rank, dist_init_addr=f"{head.addr}:{RENDEZVOUS_PORT}",
                               env={"SGLANG_HOST_IP": h.addr, "GLOO_SOCKET_IFNAME": h.ifname},
                               log_path=tmp_path / f"node{rank}.log")
                 for rank, h in enumerate(hosts.values())]
        procs = [h.popen(_private_shm(p.command()), env=p.environment(), stdout=open(p.log_path, "wb"),
                         stderr=subprocess.STDOUT) for p, h in zip(parts, hosts.values())]
        try:
            deadline = time.monotonic() + HEALTHY_S
            while _http(hosts["node1"], f"{parts[0].url}/health")["status"] != 200:
                assert all(p.poll() is None for p in procs), "a node part exited: see node*.log"
                assert time.monotonic() < deadline, f"not healthy within {HEALTHY_S} s"
                time.sleep(3)
            out = _http(hosts["node1"], f"{parts[0].url}/generate",
                        {"input_ids": PROMPT, "return_logprob": True,
                         "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
            assert out["status"] == 200, out
            meta = json.loads(out["body"])["meta_info"]
            ids = [t for _, t, _ in meta["output_token_logprobs"]]
            got = [lp for lp, _, _ in meta["output_token_logprobs"]]
            assert len(ids) == NEW_TOKENS
            assert got == pytest.approx(_hf_logprobs(tiny_dense_dir, PROMPT + ids), abs=1e-3)
            # node-rank 1 runs schedulers only: /health from SGLang's dummy server, no API
            assert _http(head, f"{parts[1].url}/health")["status"] == 200
            assert _http(head, f"{parts[1].url}/generate", {"input_ids": PROMPT})["status"] in (404, 405)
        except BaseException:
            for p in parts:
                print(f"===== {p.log_path.name}\n{p.log_tail(4000)}")
            raise
