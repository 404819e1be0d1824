"""The demo's config: the CPU training config (`sem_jax.config.cpu_config`) plus the two
sections only the demo reads, `world` (the synthetic world) and `warm_start`
(`sem_jax.settings.World` and `WarmStart` hold their fields and defaults)."""

from __future__ import annotations

from ml_collections import ConfigDict

from sem_jax.config import cpu_config
from sem_jax.settings import Config, WarmStart, World, to_config_dict

DEMO_SECTIONS = ("world", "warm_start")


def demo_config() -> ConfigDict:
    """`make demo`: a synthetic world, a tiny Qwen2 warm-started on it, then GRPO with the SEM
    reward. No downloads; 10 to 20 minutes on 2 cores."""
    c = cpu_config()
    c.world = to_config_dict(World())
    # Supervised warm start of the random-init policy on the world's templated traces, saved as an
    # HF directory in run_dir/warm_start (which the training then loads as model.path).
    c.warm_start = to_config_dict(WarmStart())
    return c


def training_config(demo: Config) -> Config:
    """The ordinary training config inside a demo config: without the demo's sections."""
    return demo.replace(**{name: None for name in DEMO_SECTIONS})
