"""megarl validate: every shipped config passes; each broken config is rejected naming its key."""
from pathlib import Path

import pytest

from megarl.cli import main as cli_main
from megarl.config import ConfigError, load_config, validate
from megarl.launch.preflight import prepare_config

REPO = Path(__file__).resolve().parents[3]
CONFIGS = sorted(p for p in (REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_validates(path, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path / "cache"))
    assert cli_main(["validate", str(path)]) == 0


def test_good_config_passes(good_overrides):
    cfg = validate(load_config(REPO / "configs" / "base.yaml", good_overrides))
    assert cfg.parallel.expert_model_parallel_size == 2


# (overrides, the key the error must name)
BROKEN = [
    (["parallel.tensor_model_parallel_size=3"], "parallel.tensor_model_parallel_size"),
    (["parallel.pipeline_model_parallel_size=4", "cluster.trainer_devices_per_node=4"],
     "parallel.pipeline_model_parallel_size"),  # 2 layers not divisible by PP=4
    (["parallel.expert_model_parallel_size=3"], "parallel.expert_model_parallel_size"),
    (["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
     "parallel.expert_model_parallel_size"),  # TP2 x EP2 with ETP=TP needs 4 ranks
    (["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=1"],
     "parallel.sequence_parallel"),  # MoE with TP>1 needs SP
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),  # SP needs TP>1
    (["parallel.virtual_pipeline_model_parallel_size=2"], "parallel.virtual_pipeline_model_parallel_size"),
    (["parallel.tensor_model_parallel_size=4", "cluster.trainer_devices_per_node=4",
      "parallel.sequence_parallel=true", "parallel.expert_tensor_parallel_size=1", "train.global_batch_size=4"],
     "parallel.tensor_model_parallel_size"),  # 2 kv heads not divisible by TP=4
    (["parallel.expert_tensor_parallel_size=0"], "parallel.expert_tensor_parallel_size"),
    (["train.global_batch_size=12"], "train.global_batch_size"),
    (["train.global_batch_size=3"], "train.global_batch_size"),
    (["train.max_tokens_per_microbatch=null", "train.micro_batch_size=3"], "train.global_batch_size"),
    (["rollout.group_size=1", "train.global_batch_size=4"], "rollout.group_size"),
    (["algorithm.clip_low=0.2"], "algorithm.clip_low"),
    (["algorithm.clip_high=-1e-4"], "algorithm.clip_high"),
    (["algorithm.policy_loss=ppo_clip", "algorithm.clip_high=1.5"], "algorithm.clip_high"),
    (["algorithm.clip_c=3.0"], "algorithm.clip_c"),
    (["algorithm.policy_loss=dapo"], "algorithm.policy_loss"),
    (["algorithm.advantage_estimator=ppo"], "algorithm.advantage_estimator"),
    (["algorithm.kl_coef=-0.1"], "algorithm.kl_coef"),
    (["algorithm.rollout_correction_clip=0.5"], "algorithm.rollout_correction_clip"),
    (["train.fp8=e4m3"], "train.fp8"),  # FP8 on CPU
    (["train.precision=bf16"], "train.precision"),  # CPU trains in fp32
    (["train.routing_replay=r4"], "train.routing_replay"),
    (["train.lr=-1"], "train.lr"),
    (["train.num_steps=0"], "train.num_steps"),
    (["train.max_tokens_per_microbatch=100"], "train.max_tokens_per_microbatch"),
    (["rollout.num_engines=3"], "rollout.num_engines"),  # 3 engines on 1 rollout device
    (["rollout.engine.tensor_parallel_size=3", "cluster.rollout_devices_per_node=3"],
     "rollout.engine.tensor_parallel_size"),  # 4 heads not divisible by engine TP 3
    (["weight_sync.transport=tensor"], "weight_sync.transport"),  # needs colocated
    (["weight_sync.transport=nccl"], "weight_sync.transport"),
    (["cluster.placement=colocated", "cluster.device=cuda", "weight_sync.transport=distributed"],
     "weight_sync.transport"),  # NCCL refuses two ranks on one GPU (issue 18 item 8)
    (["cluster.placement=colocated", "cluster.device=cuda", "weight_sync.transport=p2p"],
     "weight_sync.transport"),  # the same for the shard-to-shard transport's process group
    (["cluster.placement=colocated", "cluster.device=cuda", "weight_sync.transport=tensor",
      "rollout.async_mode=true", "rollout.max_staleness=1"], "rollout.async_mode"),  # engines idle only
    (["weight_sync.bucket_size_mb=0"], "weight_sync.bucket_size_mb"),
    (["weight_sync.senders_per_stage=0"], "weight_sync.senders_per_stage"),
    (["cluster.placement=spread"], "cluster.placement"),
    (["rollout.reward=nonexistent_reward"], "rollout.reward"),
    (["rollout.tools={no_such_tool: {}}"], "rollout.tools.no_such_tool"),
    (["data.train_path=/nonexistent/train.jsonl"], "data.train_path"),
    (["data.max_prompt_tokens=99999"], "data.max_prompt_tokens"),
    (["model.hf_path=/nonexistent/model"], "model.hf_path"),
    (["model.moe_token_dispatcher_type=flex"], "model.moe_token_dispatcher_type"),
    (["model.unknown_field=1"], "model.unknown_field"),  # unknown key
    (["parallel.tensor_model_parallel_size=two"], "parallel.tensor_model_parallel_size"),  # wrong type
    (["nosuchsection.x=1"], "nosuchsection"),
    (["rollout.agent.tool_call_parser=qwen4"], "rollout.agent.tool_call_parser"),  # not an SGLang detector
    (["rollout.agent.reasoning_parser=qwen4"], "rollout.agent.reasoning_parser"),
]


@pytest.mark.parametrize("overrides,key", BROKEN, ids=[k + ":" + ",".join(o) for o, k in BROKEN])
def test_broken_config_names_its_key(good_overrides, overrides, key):
    with pytest.raises(ConfigError) as err:
        validate(load_config(REPO / "configs" / "base.yaml", good_overrides + overrides))
    keys = [issue.key for issue in err.value.issues]
    assert key in keys, f"expected an error naming {key}, got: {err.value}"
    assert key in str(err.value)


def test_auto_transport_is_tensor_for_colocated_cuda_engines(good_overrides):
    """``auto`` (the default) validates colocated on CUDA and means ``tensor`` there (NCCL cannot
    join two ranks on one GPU); elsewhere it stays ``auto`` (resolved by the senders)."""
    from megarl.weight_sync.choice import run_transport

    colocated = ["cluster.placement=colocated", "cluster.device=cuda"]
    cfg = load_config(REPO / "configs" / "base.yaml", good_overrides + colocated)
    assert cfg.weight_sync.transport == "auto" and run_transport(cfg, cuda=True) == "tensor"
    assert run_transport(cfg, cuda=False) == "auto"  # colocated on CPU: the senders resolve it
    try:
        validate(cfg)
    except ConfigError as err:  # other checks may object to CUDA on this machine; not the transport
        assert "weight_sync.transport" not in {i.key for i in err.issues}, str(err)
    cfg = load_config(REPO / "configs" / "base.yaml", good_overrides)
    assert run_transport(cfg, cuda=True) == "auto"
    cfg = load_config(REPO / "configs" / "base.yaml", good_overrides + colocated + ["weight_sync.transport=disk"])
    assert run_transport(cfg, cuda=True) == "disk"


def test_tied_qwen3_moe_is_accepted(good_overrides, tiny_tied_moe_dir):
    """SGLang's Qwen3MoeForCausalLM keeps its own lm_head (tests/unit/rollout/test_engine_view.py), so the
    engines serve an untied view and every sync sends the embedding as lm_head.weight: nothing to refuse."""
    validate(load_config(REPO / "configs" / "base.yaml", good_overrides + [f"model.hf_path={tiny_tied_moe_dir}"]))


def test_all_errors_reported_at_once(good_overrides):
    overrides = ["parallel.tensor_model_parallel_size=3", "algorithm.clip_low=0.2", "train.lr=-1", "foo=1"]
    with pytest.raises(ConfigError) as err:
        validate(load_config(REPO / "configs" / "base.yaml", good_overrides + overrides))
    assert len(err.value.issues) == 1  # unknown key 'foo' stops loading (typed fields are unknown)
    with pytest.raises(ConfigError) as err:
        validate(load_config(REPO / "configs" / "base.yaml", good_overrides + overrides[:3]))
    keys = {i.key for i in err.value.issues}
    assert {"parallel.tensor_model_parallel_size", "algorithm.clip_low", "train.lr"} <= keys


def test_hf_config_spellings(tmp_path, good_overrides, tiny_moe_dir):
    """transformers 4.x spelling (num_experts, rope_theta) and 5.x (num_local_experts) both validate."""
    import json
    import shutil

    old = tmp_path / "old_spelling"
    shutil.copytree(tiny_moe_dir, old)
    cfg_json = json.loads((old / "config.json").read_text())
    cfg_json["num_experts"] = cfg_json.pop("num_local_experts", cfg_json.get("num_experts"))
    cfg_json["rope_theta"] = cfg_json.pop("rope_parameters", {}).get("rope_theta", 1e6)
    (old / "config.json").write_text(json.dumps(cfg_json))
    validate(load_config(REPO / "configs" / "base.yaml", good_overrides + [f"model.hf_path={old}"]))
    with pytest.raises(ConfigError, match="num_moe_experts=8"):
        validate(load_config(REPO / "configs" / "base.yaml",
                             good_overrides + [f"model.hf_path={old}", "parallel.expert_model_parallel_size=3",
                                               "cluster.trainer_devices_per_node=3", "train.global_batch_size=16"]))


def test_cluster_allocation_env(good_overrides, monkeypatch):
    monkeypatch.setenv("MEGARL_ALLOC_NODES", "1")
    with pytest.raises(ConfigError, match="MEGARL_ALLOC_NODES"):
        validate(load_config(REPO / "configs" / "base.yaml", good_overrides))


def test_tiny_uri_errors_name_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="model.hf_path.*hidden_sise"):
        prepare_config(str(REPO / "configs" / "base.yaml"), ["model.hf_path=tiny:qwen3_moe?hidden_sise=8"])


def test_unsupported_model_type(tmp_path, good_overrides, tiny_dense_dir):
    import json
    import shutil

    other = tmp_path / "llama"
    shutil.copytree(tiny_dense_dir, other)
    cfg_json = json.loads((other / "config.json").read_text())
    cfg_json.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (other / "config.json").write_text(json.dumps(cfg_json))
    with pytest.raises(ConfigError, match="model.hf_path.*'llama' is not supported"):
        validate(load_config(REPO / "configs" / "base.yaml",
                             good_overrides + [f"model.hf_path={other}", "parallel.expert_model_parallel_size=1"]))


def test_parser_names_resolve_like_the_agent_loop(good_overrides):
    """``megarl validate`` accepts exactly the parser names the agent loop's own resolution accepts."""
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    from megarl.rollout.reasoning import parser_issues

    for name in ("glm45", "deepseekv3", "qwen25"):
        assert name in FunctionCallParser.ToolCallParserEnum
        validate(load_config(REPO / "configs" / "base.yaml", good_overrides + [f"rollout.agent.tool_call_parser={name}"]))
    for name in ("none", "deepseek-r1", "glm45"):
        assert name == "none" or name in ReasoningParser.DetectorMap
        validate(load_config(REPO / "configs" / "base.yaml", good_overrides + [f"rollout.agent.reasoning_parser={name}"]))
    issues = dict(parser_issues("llama", "auto", "auto"))  # a family with no default: both keys named
    assert set(issues) == {"rollout.agent.reasoning_parser", "rollout.agent.tool_call_parser"}
    assert parser_issues("llama", "none", "llama3") == [] and parser_issues(None, "auto", "auto") == []
