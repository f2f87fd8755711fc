"""moe_rl: RL trainer for Mixture-of-Experts LLMs with engine/trainer consistency."""
from setuptools import find_packages, setup

setup(
    name="moe_rl",
    version="0.1.0",
    description="GRPO/GSPO RL for MoE LLMs on megatron-core with routing replay and "
    "training-inference mismatch corrections",
    python_requires=">=3.11",
    packages=find_packages(include=["moe_rl", "moe_rl.*"]) + ["moe_rl_kernels", "moe_rl.configs"],
    # The top-level kernels/ folder installs as `moe_rl_kernels` (a bare `kernels` would collide
    # with the PyPI package of that name); configs/ ships as `moe_rl.configs` (package data, so
    # `moe-rl demo --config tiny_cpu.yaml` works from a wheel installed anywhere).
    package_dir={"moe_rl_kernels": "kernels", "moe_rl.configs": "configs"},
    package_data={"moe_rl.configs": ["*.yaml", "data/*.jsonl"],
                  "moe_rl.engines.sglang": ["cpu_requirements.txt"]},
    # Ranges: the lower bound is the oldest version whose API moe_rl uses (SGLang 0.5.23's own
    # pins, transformers 5.19.0 and tokenizers 0.23.2, must fit for the [sglang] extra); the
    # upper bound stops before a release that may remove what moe_rl calls (megatron-core
    # changes its API between minor releases; transformers removes `past_key_values` in 5.40).
    # megatron-core 0.17+ needs Python 3.12: pip resolves 0.16.x on 3.11 and 0.19.x on 3.12,
    # both tested (`make test`, `make test-upstream`); from 0.17 on it imports triton.
    install_requires=[
        "torch>=2.6,<3",
        "megatron-core>=0.16,<0.20",
        "triton>=3.2,<4; python_version >= '3.12' and sys_platform == 'linux'",
        "transformers>=5.19,<5.40",
        "tokenizers>=0.22,<0.24",
        "safetensors>=0.4,<1",
        "einops>=0.7,<1",
        "numpy>=1.26,<3",
        "pyyaml>=6,<7",
        "ray>=2.40,<3",
        "tensorboard>=2.15,<3",
        "tqdm>=4.66,<5",
        "httpx>=0.27,<1",
        "fastapi>=0.110,<1",
        "uvicorn>=0.29,<1",
        "pyarrow>=14,<28",
        "matplotlib>=3.8,<4",
        "psutil>=5.9,<8",   # megatron-core dist_checkpointing writer
        "accelerate>=1.0,<2",   # transformers' MXFP4 loader (check-model on gpt-oss's release)
        "math-verify[antlr4-13-2]>=0.9,<0.10",   # data.reward: math
    ],
    extras_require={
        "test": ["pytest>=8,<9", "pytest-timeout>=2.3,<3", "pytest-xdist>=3.5,<4",
                 "filelock>=3.12,<5", "triton>=3.2,<4", "packaging>=23,<27",
                 "radon>=6,<7"],
        "sglang": ["sglang>=0.5.23,<0.6"],
        "te": ["transformer-engine[pytorch]>=2.0,<3"],
        "docs": ["mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10"],
        "wandb": ["wandb>=0.19,<1"],
    },
    entry_points={"console_scripts": ["moe-rl=moe_rl.cli:main"]},
)
