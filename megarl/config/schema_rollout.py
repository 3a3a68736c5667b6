"""The rollout side of megarl's configuration schema: sampling, the agent loop, the SGLang engines,
the ``rollout`` section that holds them, and the ``retrieval`` service. Re-exported by
:mod:`megarl.config.schema` (the module docstring there describes the schema as a whole)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingConfig:
    """SGLang sampling parameters for one generate call (one turn)."""

    temperature: float = 1.0
    """Sampling temperature (0 = greedy)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    max_new_tokens: int = 512
    """Upper bound on tokens generated in one turn."""
    stop: list[str] = field(default_factory=list)
    """Extra stop strings."""


@dataclass
class AgentConfig:
    """The multi-turn agent loop."""

    name: str = "tool_agent"
    """Agent loop, by registry name (``tool_agent``, ``single_turn``, or one a plugin registers) or
    import path (``my_pkg.agents:my_loop``)."""
    max_turns: int = 4
    """Maximum generate calls per trajectory."""
    max_response_tokens: int = 1024
    """Maximum response tokens (model and tool tokens) per trajectory."""
    max_context_tokens: int = 4096
    """Prompt + response limit; stop (truncated) before exceeding it."""
    system_prompt: str | None = None
    """System message prepended to every prompt."""
    tool_call_parser: str = "auto"
    """SGLang FunctionCallParser name (``qwen25`` covers Qwen2.5 and Qwen3, ``deepseekv3``, ``glm45``);
    ``auto`` = the model family's (``model_type`` in config.json, see megarl/rollout/reasoning.py)."""
    reasoning_parser: str = "auto"
    """SGLang ReasoningParser name (``qwen3``, ``deepseek-v3``, ``glm45``) splitting each turn into
    reasoning and answer (tool calls and rewards read the answer only); ``auto`` = the model
    family's; ``none`` = no separation."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to every chat-template render: the prompt, each observation suffix with its generation
    prompt, and the SFT demonstrations (e.g. ``enable_thinking: false`` for Qwen3 / GLM-4.5)."""
    max_tool_output_chars: int = 2048
    """Tool observations longer than this are truncated."""
    tool_timeout_s: float = 60.0
    """Wall-clock limit of one tool call in the agent loop (a tool may enforce a shorter one, e.g.
    ``rollout.tools.python.timeout_s``); a timeout becomes an error observation."""


@dataclass
class EngineConfig:
    """SGLang server settings for each rollout engine."""

    tensor_parallel_size: int = 1
    """TP size of each SGLang engine (GPUs per engine without EP)."""
    expert_parallel_size: int = 1
    """EP size inside each SGLang engine."""
    host: str = "auto"
    """Address each engine binds and advertises. ``auto``: its node's address when the Ray cluster
    spans several hosts (trainer ranks and the rollout worker must reach it), ``127.0.0.1`` when it
    is on one host. An explicit loopback address on a multi-host cluster is an error at start."""
    base_port: int = 30000
    """First HTTP port; engine i uses a free port at or above base_port + 10 * i (within 1000 ports:
    the range a firewalled cluster opens), chosen on the engine's node."""
    mem_fraction_static: float = 0.8
    """SGLang ``--mem-fraction-static`` (weights and KV cache, of each GPU's memory). Colocated on CUDA
    it shares the GPU with the trainer: with ``cluster.colocated_trainer_memory_fraction`` it must
    fit (``megarl validate``)."""
    max_total_tokens: int | None = None
    """SGLang ``--max-total-tokens`` (KV cache size); None = SGLang's choice."""
    startup_timeout_s: float = 300.0
    """Seconds to wait for ``/health`` after launch."""
    request_timeout_s: float = 600.0
    """Seconds before one generate request is abandoned."""
    extra_args: list[str] = field(default_factory=list)
    """Extra ``sglang.launch_server`` arguments, verbatim."""
    dtype: str = "auto"
    """SGLang ``--dtype``: ``auto`` (the checkpoint's), ``bfloat16``, ``float16`` or ``float32``."""
    grammar_backend: str = "xgrammar"
    """SGLang ``--grammar-backend`` for regex / json_schema constrained decoding (``none`` = off)."""
    sleep_on_idle: bool = True
    """SGLang ``--sleep-on-idle``: an idle engine waits on its request sockets instead of spinning a
    CPU core (which the trainer or the tools on the same host would otherwise lose)."""


@dataclass
class RolloutConfig:
    """Rollout: engines, sampling, agent loop, tools and reward."""

    num_engines: int = 1
    """SGLang engines started by megarl (ignored when ``external_engine_urls`` is set)."""
    external_engine_urls: list[str] = field(default_factory=list)
    """Already running SGLang servers to use instead of launching engines."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Per-engine server settings."""
    group_size: int = 8
    """Trajectories per prompt (G)."""
    num_prompts_per_step: int = 8
    """Prompts per RL step; the step produces ``num_prompts_per_step * group_size`` trajectories."""
    over_sample_prompts: int = 0
    """Extra prompts started per step; the excess is aborted once enough groups are ready."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling parameters of training rollouts."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """The agent loop."""
    tools: dict[str, Any] = field(default_factory=dict)
    """Tools by registry name or import path -> their settings (``{python: {timeout_s: 5}}``)."""
    reward: str = "gsm8k"
    """Reward function, by registry name or import path (``my_pkg.tasks:ExactMatch``)."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Settings of the reward function."""
    async_mode: bool = False
    """Overlap rollout of step k+1 with training of step k (off = on-policy)."""
    max_staleness: int = 1
    """Async mode: the most policy versions a trained trajectory may lag behind."""
    partial_rollouts: bool = False
    """Resume aborted trajectories after a weight update instead of discarding them."""
    deterministic_sampling: bool = False
    """Seed every generate call from ``(train.seed, step, request token ids)`` and launch the engines
    with ``--enable-deterministic-inference``, so a resumed run samples what an uninterrupted one would."""


@dataclass
class RetrievalConfig:
    """The retrieval service the ``search`` tool calls (:mod:`megarl.retrieval`)."""

    index: str | None = None
    """Index directory (``megarl index build CORPUS OUT``); None = no service is started."""
    backend: str = "bm25"
    """``bm25`` (bm25s) or ``dense`` (faiss over all-MiniLM-L6-v2); must be the index's backend."""
    corpus: str | None = None
    """The corpus file the index must have been built from (SHA-256 compared at start); None = no check."""
    url: str | None = None
    """An already running service to use instead of starting one (then ``index`` is ignored)."""
    host: str = "auto"
    """Address the service binds: ``auto`` = 127.0.0.1, or in a Slurm job (nodes advertising
    ``megarl_node_<i>``) the address of the first rollout node, where the service is placed."""
    port: int | None = None
    """HTTP port; None = a free one."""
    max_batch_queries: int = 64
    """Concurrent queries coalesced into one library call."""
    max_wait_ms: float = 2.0
    """How long an open batch waits for more queries."""
    startup_timeout_s: float = 300.0
    """Seconds to wait for the service's ``/health``."""
