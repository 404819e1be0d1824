"""The CPU demo (`python -m sem_jax.demo`): a synthetic world, a warm start, GRPO; no downloads."""

from sem_jax.config import demo_config


def get_config():
    return demo_config()
