"""Each CPU patch of megarl.training.cpu_compat is still needed, and sufficient for its probe.

One subprocess imports Megatron-Core once and forks a child per case. A child applies every patch
except one, runs that patch's probe (a tiny Megatron operation) and reports the exception; a
control child applies all patches and runs every probe, which must then succeed.
Run directly (``python test_cpu_compat.py``) to print the JSON report.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback

import pytest

# patch name -> (expected exception type, substring of the documented failure)
EXPECTED = {
    "rng": ("AssertionError", "not compiled with CUDA"),
    "current_device": ("AssertionError", "not compiled with CUDA"),
    "moe_te_gemm": ("NameError", "te_general_gemm"),
    "cuda_device_args": ("AssertionError", "not compiled with CUDA"),
    "tensor_type_names": ("TypeError", "Wrapped parameters must be one of"),
    "cuda_sync": ("AssertionError", "not compiled with CUDA"),
    "cuda_stream": ("RuntimeError", "torch.cuda.Stream requires CUDA"),
    "moe_splits_numpy": ("TypeError", "split_sizes"),
    "torchnorm_sp": ("AssertionError", "sequence parallel not supported"),
    "expert_bias_inplace": ("RuntimeError", "is a view and is being modified inplace"),
}


def _config(**overrides):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=1, hidden_size=32, num_attention_heads=2, num_moe_experts=2,
              moe_router_topk=2, moe_ffn_hidden_size=16, use_cpu_initialization=True,
              params_dtype=torch.float32, add_bias_linear=False, gradient_accumulation_fusion=False,
              bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
              bias_activation_fusion=False, persist_layer_norm=False, pipeline_dtype=torch.float32)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _probe(name: str) -> None:
    """Run the Megatron operation that needs patch ``name`` (raises without it)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if name == "rng":
        tensor_parallel.model_parallel_cuda_manual_seed(7)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            pass
    elif name == "current_device":
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=False)(4)
    elif name == "moe_te_gemm":
        from megatron.core.transformer.moe.moe_utils import router_gating_linear
        router_gating_linear(torch.ones(3, 4), torch.ones(2, 4), None, torch.float32)
    elif name == "cuda_device_args":
        from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
        get_grad_norm_fp32([torch.ones(3)], grad_stats_parallel_group=dist.group.WORLD)
    elif name == "tensor_type_names":
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer.grad_scaler import ConstantGradScaler
        from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
        param = torch.nn.Parameter(torch.ones(2))
        Float16OptimizerWithFloat16Params(torch.optim.SGD([param], lr=0.1), OptimizerConfig(lr=0.1),
                                          ConstantGradScaler(1.0), None)
    elif name == "cuda_sync":
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
        comm = P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), _config())
        comm._communicate_shapes(None, None, False, False)
    elif name == "cuda_stream":
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
        MoEAlltoAllTokenDispatcher(2, [0, 1], _config(moe_token_dispatcher_type="alltoall"),
                                   ProcessGroupCollection.use_mpu_process_groups())
    elif name == "moe_splits_numpy":
        # The dispatcher's exact composition: split sizes from maybe_move_tensor_to_cpu(as_numpy)
        # handed to all_to_all_single (megatron's _AllToAll short-circuits at world size 1).
        from megatron.core.transformer.moe import token_dispatcher
        splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3]), as_numpy=True)
        dist.all_to_all_single(torch.empty(3), torch.ones(3), output_split_sizes=splits,
                               input_split_sizes=splits, group=dist.group.WORLD)
    elif name == "torchnorm_sp":
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        norm = WrappedTorchNorm(_config(tensor_model_parallel_size=2, sequence_parallel=True), 32)
        assert all(p.sequence_parallel for p in norm.parameters()), "norm params not tagged"
    elif name == "expert_bias_inplace":  # RowParallelLinear's reduce at TP 1, then MLP.forward's in-place bias
        from megatron.core.tensor_parallel import layers
        x = torch.ones(2, 3, requires_grad=True)
        group = parallel_state.get_tensor_model_parallel_group()  # 1 rank
        out = layers.reduce_from_tensor_model_parallel_region(x * 2.0, group=group)
        out += torch.ones(3)
        out.sum().backward()
        assert torch.equal(x.grad, torch.full((2, 3), 2.0)), x.grad
    else:
        raise KeyError(name)


def _child(case: str, store: str, write_fd: int) -> None:
    """Forked child: patches, 1-rank gloo group, probe(s); writes a JSON result and exits."""
    result = {}
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state

        from megarl.training import cpu_compat

        names = list(cpu_compat.PATCHES)
        skipped = None if case == "control" else case
        cpu_compat.apply_cpu_patches([n for n in names if n != skipped])
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        if case == "control":  # the patches must not break torch's device context (meta init)
            import torch
            with torch.device("meta"):
                result["meta_context"] = None if torch.empty(2).is_meta and torch.tensor([1.0]).is_meta \
                    else ["AssertionError", "torch.device('meta') context no longer applies", ""]
        for name in (names if case == "control" else [case]):
            try:
                _probe(name)
                result[name] = None
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                result[name] = [type(exc).__name__, str(exc)[:300], traceback.format_exc(limit=-3)]
    except BaseException as exc:  # noqa: BLE001
        result["setup"] = [type(exc).__name__, str(exc)[:300], traceback.format_exc()]
    os.write(write_fd, json.dumps(result).encode())
    os._exit(0)


def run_cases() -> dict:
    """Fork one child per patch plus a control; return {case: {probe: None | [type, msg, tb]}}."""
    import warnings
    warnings.filterwarnings("ignore")
    import megatron.core.optimizer  # import once, before forking
    import megatron.core.pipeline_parallel
    import megatron.core.transformer.moe.token_dispatcher  # noqa: F401

    from megarl.training import cpu_compat

    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in ["control", *cpu_compat.PATCHES]:
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read_fd)
                _child(case, os.path.join(tmp, f"store_{case}"), write_fd)
            os.close(write_fd)
            chunks = []
            while chunk := os.read(read_fd, 65536):
                chunks.append(chunk)
            os.close(read_fd)
            os.waitpid(pid, 0)
            report[case] = json.loads(b"".join(chunks) or b'{"setup": ["died", "", ""]}')
    return report


@pytest.fixture(scope="module")
def report():
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(150)
def test_all_patches_make_every_probe_pass(report):
    assert report["control"] == {"meta_context": None, **{n: None for n in EXPECTED}}, report["control"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", list(EXPECTED))
def test_patch_is_still_needed(report, name):
    outcome = report[name]
    assert "setup" not in outcome, outcome
    assert outcome[name] is not None, f"probe {name} passed without its patch: the patch may be obsolete"
    exc_type, message, tb = outcome[name]
    want_type, want_text = EXPECTED[name]
    assert exc_type == want_type and want_text in message, (exc_type, message, tb)


def test_patch_names_match_expectations():
    from megarl.training import cpu_compat

    assert list(cpu_compat.PATCHES) == list(EXPECTED)


def test_refuses_other_megatron_version(monkeypatch):
    import importlib.metadata

    from megarl.training import cpu_compat

    monkeypatch.setattr(importlib.metadata, "version", lambda pkg: "0.17.0")
    with pytest.raises(RuntimeError, match=r"written for megatron-core 0\.16\.1, but 0\.17\.0"):
        cpu_compat.apply_cpu_patches(["moe_te_gemm"], force=True)


def test_unknown_patch_name():
    from megarl.training import cpu_compat

    with pytest.raises(KeyError, match="unknown CPU patch"):
        cpu_compat.apply_cpu_patches(["no_such_patch"], force=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))
    print(json.dumps(run_cases()))
