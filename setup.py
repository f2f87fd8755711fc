"""moe_rl: RL trainer for Mixture-of-Experts LLMs with engine/trainer consistency."""
from setuptools import find_packages, setup

setup(
    name="moe_rl",
    version="0.1.0",
    description="GRPO/GSPO RL for MoE LLMs on megatron-core with routing replay and "
    "training-inference mismatch corrections",
    python_requires=">=3.11",
    packages=find_packages(include=["moe_rl", "moe_rl.*"]) + ["moe_rl_kernels"],
    # The top-level kernels/ folder installs as `moe_rl_kernels` (a bare `kernels`
    # would collide with the PyPI package of that name).
    package_dir={"moe_rl_kernels": "kernels"},
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16",
        "transformers>=4.51",
        "tokenizers>=0.20",
        "safetensors>=0.4",
        "einops",
        "numpy",
        "pyyaml>=6",
        "ray>=2.40",
        "tensorboard>=2.15",
        "tqdm",
        "httpx>=0.27",
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "pyarrow>=14",
        "matplotlib>=3.8",
        "psutil>=5.9",   # megatron-core dist_checkpointing writer
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "triton>=3.2"],
        "sglang": ["sglang>=0.5.23"],
        "te": ["transformer-engine[pytorch]"],
    },
    entry_points={"console_scripts": ["moe-rl=moe_rl.cli:main"]},
)
