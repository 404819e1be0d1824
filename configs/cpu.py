"""The embedded default of `sem_jax.train`: a tiny random Qwen2 on the CPU, bundled questions, no downloads."""

from sem_jax.config import cpu_config


def get_config():
    return cpu_config()
