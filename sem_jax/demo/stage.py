"""The demo stage: writes run_dir/world and run_dir/warm_start, then trains as any run does."""

from __future__ import annotations

import os

import jax
from jax.experimental import multihost_utils

from sem_jax.assemble import build_policy, build_retriever
from sem_jax.config import training_config
from sem_jax.demo.warm_start import warm_start
from sem_jax.demo.world import build_world, summarize, texts, use_world_files, world_config
from sem_jax.model import save_pretrained
from sem_jax.config import Config


def prepare(config: Config) -> Config:
    """Write the world and the warm start into `config.run_dir` (each once: a resumed demo reuses
    them) and return the training config that reads them."""
    run_dir = os.path.abspath(config.run_dir)
    world = build_world(world_config(config))
    train_config = use_world_files(training_config(config), world.write(os.path.join(run_dir, "world")))
    print(summarize(world), flush=True)
    out = os.path.join(run_dir, "warm_start")
    if os.path.exists(os.path.join(out, "config.json")):
        print(f"warm start: loading {out}", flush=True)
    else:
        # The tiny model's BPE: the world's text, and the protocol's tags repeated so that they merge.
        model, tokenizer = build_policy(train_config, lambda: texts(world) + [config.system_prompt] * 50, run_dir)
        warm_start(config, model, tokenizer, build_retriever(train_config), world)
        if jax.process_index() == 0:
            save_pretrained(model, out)
            tokenizer.save_pretrained(out)
        if jax.process_count() > 1:  # every process loads what process 0 wrote
            multihost_utils.sync_global_devices("sem_jax.demo warm start")
    return train_config.replace(**{"model.path": out})
