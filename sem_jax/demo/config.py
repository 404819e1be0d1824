"""The demo's config: the CPU training config (`sem_jax.config.cpu_config`) plus the two
sections only the demo reads, `world` (the synthetic world) and `warm_start`."""

from __future__ import annotations

import dataclasses

from ml_collections import ConfigDict

from sem_jax.config import cpu_config
from sem_jax.demo.world import WorldConfig

DEMO_SECTIONS = ("world", "warm_start")


def demo_config() -> ConfigDict:
    """`make demo`: a synthetic world, a tiny Qwen2 warm-started on it, then GRPO with the SEM
    reward. No downloads; 10 to 20 minutes on 2 cores."""
    c = cpu_config()
    c.world = ConfigDict({k: v for k, v in dataclasses.asdict(WorldConfig()).items() if k != "seed"})
    # Supervised warm start of the random-init policy on the world's templated traces, saved as an
    # HF directory in run_dir/warm_start (which the training then loads as model.path).
    c.warm_start = ConfigDict(dict(
        lr=3e-3, rows=12, search_prob_a=0.8,
        search_prob_b=0.4,  # at 0.2-0.3 GRPO sampled no search for some phrasing-B kinds: nothing to learn from
        copy_steps=400,     # first: copying random token strings (sft.copy_pairs); without it a
                            # tiny model never copied a name into a query
        lookup_steps=0,     # then: steps on lookups alone (every trace searches)
        steps=600,          # then: the whole mix
        known_copies=48,    # known facts must be memorised: repeated
        lookup_copies=1))
    return c


def training_config(demo: ConfigDict) -> ConfigDict:
    """The ordinary training config inside a demo config: a copy without the demo's sections."""
    c = demo.copy_and_resolve_references()
    with c.unlocked():
        for name in DEMO_SECTIONS:
            del c[name]
    return c
