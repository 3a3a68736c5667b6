"""Shared pytest fixtures: tiny models (built once per session) and the GPU skip rule."""
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE HF directory (2 layers, 8 experts, top-2, fp32), built once per session."""
    from megarl.models.tiny import TinyModelSpec, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_moe", TinyModelSpec(family="qwen3_moe"))


@pytest.fixture(scope="session")
def tiny_dense_dir(tmp_path_factory):
    """A tiny dense Qwen3 HF directory (2 layers, fp32), built once per session."""
    from megarl.models.tiny import TinyModelSpec, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_dense", TinyModelSpec(family="qwen3"))


@pytest.fixture(scope="session")
def tiny_tied_moe_dir(tmp_path_factory):
    """The tiny Qwen3-MoE with ``tie_word_embeddings=true`` (no ``lm_head.weight``), built once per session."""
    from megarl.models.tiny import TinyModelSpec, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_tied_moe",
                           TinyModelSpec(family="qwen3_moe", tie_word_embeddings=True))


@pytest.fixture(scope="session")
def tiny_deepseek_v3_dir(tmp_path_factory):
    """A tiny DeepSeek-V3 HF directory (2 layers: dense then MoE; MLA, YaRN, 8 experts in 4 groups,
    top-2, a shared expert, random router bias and norms; fp32), built once per session."""
    from megarl.models.tiny import TinyModelSpec, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_deepseek_v3", TinyModelSpec(family="deepseek_v3"))


@pytest.fixture(scope="session")
def tiny_glm4_moe_dir(tmp_path_factory):
    """A tiny GLM-4.5 HF directory (2 layers: dense then MoE; partial rotary, q/k norm, qkv bias,
    8 experts, top-2, a shared expert, random router bias and norms; fp32), built once per session."""
    from megarl.models.tiny import TinyModelSpec, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_glm4_moe", TinyModelSpec(family="glm4_moe"))


@pytest.fixture(scope="session")
def tiny_gpt_oss_dir(tmp_path_factory):
    """A tiny gpt-oss HF directory (2 layers: sliding window 4 then full attention; sinks, YaRN,
    8 experts top-2 stacked in HF's gate_up_proj / down_proj, random biases and norms; fp32),
    built once per session."""
    from megarl.models.tiny import TinyModelSpec, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_gpt_oss", TinyModelSpec(family="gpt_oss"))


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_dir(tmp_path_factory):
    """A tiny Qwen3.5-MoE language model HF directory (4 layers: three gated-DeltaNet layers then a
    gated full-attention layer; DeltaNet GQA 2 key / 4 value heads, partial RoPE 0.25, 8 experts
    top-2 and a gated shared expert, random norms; fp32), built once per session."""
    from megarl.models.tiny import TinyModelSpec, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_qwen3_5_moe",
                           TinyModelSpec(family="qwen3_5_moe", num_hidden_layers=4))


@pytest.fixture(scope="session")
def tiny_minimax_m2_dir(tmp_path_factory):
    """A tiny MiniMax-M2 HF directory (2 layers, both MoE: q/k RMSNorm over all heads, partial RoPE
    (rotary_dim 8 of 16), 8 experts top-2 under a sigmoid router with random expert bias, random
    norms; fp32), built once per session."""
    from megarl.models.tiny import TinyModelSpec, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_minimax_m2", TinyModelSpec(family="minimax_m2"))


@pytest.fixture(scope="session")
def tiny_deepseek_v32_dir(tmp_path_factory):
    """A tiny DeepSeek-V3.2 HF directory: the tiny DeepSeek-V3 (2 layers: dense then MoE; MLA, YaRN,
    8 experts in 4 groups, top-2, a shared expert, random router bias and norms) with a lightning
    indexer in each layer (8 heads of 16, rope on 8 dims, top 8 keys, random key norm); fp32, built
    once per session."""
    from megarl.models.tiny import TinyModelSpec, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_deepseek_v32",
                           TinyModelSpec(family="deepseek_v32"))


@pytest.fixture(scope="session")
def tiny_kimi_k25_dir(tmp_path_factory):
    """A tiny Kimi-K2.5 HF directory: the release's layout (``language_model.*`` text backbone, a
    one-block ``vision_tower.*`` and ``mm_projector.*``), its ``text_config`` the tiny DeepSeek-V3
    (MLA, YaRN, 8 experts in 4 groups, top-2, a shared expert, random router bias and norms; fp32),
    built once per session."""
    from megarl.models.tiny import TinyModelSpec, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_kimi_k25", TinyModelSpec(family="kimi_k25"))


@pytest.fixture(scope="session")
def official_template_tokenizers(tmp_path_factory):
    """Tokenizers of tiny models built on each official chat template (megarl/models/chat_templates):
    ``{"qwen3": ..., "deepseek_r1": ..., "deepseek_v31": ..., "glm4_moe": ...}`` (Qwen3 dense, DeepSeek-V3
    (R1's and V3.1's templates), GLM-4.5 families;
    their directories hold config.json and generation_config.json), built once per session."""
    from transformers import AutoTokenizer

    from megarl.models.tiny import TinyModelSpec, make_tiny_model

    families = {"qwen3": "qwen3", "deepseek_r1": "deepseek_v3", "deepseek_v31": "deepseek_v3", "glm4_moe": "glm4_moe"}
    root = tmp_path_factory.mktemp("official_templates")
    return {template: AutoTokenizer.from_pretrained(make_tiny_model(
        root / template, TinyModelSpec(family=family, chat_template=template, num_hidden_layers=1)))
        for template, family in families.items()}
