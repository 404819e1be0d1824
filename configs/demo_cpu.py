"""The embedded default: a tiny random Qwen2 on the CPU, demo data, no downloads."""

from sem_jax.config import demo_config


def get_config():
    return demo_config()
