"""The demo's supervised warm start: a random-init policy learns copying, then the answer-first
format on the world's templated traces (`world.warm_start_pairs`)."""

from __future__ import annotations

import dataclasses
import functools

from sem_jax.demo.world import World, warm_start_pairs
from sem_jax.model.qwen2 import Qwen2
from sem_jax import sft
from sem_jax.sft import copy_pairs
from sem_jax.config import Config


def warm_start(config: Config, model: Qwen2, tokenizer, retriever, world: World) -> Qwen2:
    """Train `model` in place as `config.warm_start` says; returns it."""
    w = config.warm_start
    traces = functools.partial(warm_start_pairs, tokenizer=tokenizer, retriever=retriever,
                               top_k=config.retrieval.top_k,
                               max_tokens_per_passage=config.retrieval.max_tokens_per_passage,
                               system_prompt=config.system_prompt, seed=config.seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # Under the layer scan, as the demo's figures were measured (per-layer sums round differently).
    supervised_finetune = functools.partial(sft.supervised_finetune, per_layer=False)
    if w.copy_steps:
        special = set(tokenizer.all_special_ids)
        words = [i for i in range(256, len(tokenizer)) if i not in special]  # past the byte alphabet
        print(f"warm start: copying random token strings, {w.copy_steps} steps", flush=True)
        supervised_finetune(model, copy_pairs(words, 20_000, config.seed), steps=w.copy_steps, lr=w.lr,
                            rows=w.rows, seed=config.seed, pad_id=pad, log_every=max(1, w.copy_steps // 5))
    if w.lookup_steps:
        # Lookups alone before the mix: copying the question into the query and the answer out of the
        # passage is the skill a tiny model is slowest to pick up amid everything else.
        lookups = traces(dataclasses.replace(world, known=[]), search_prob=(1.0, 1.0), copies=(0, w.lookup_copies))
        print(f"warm start: {len(lookups)} lookup traces, {w.lookup_steps} steps", flush=True)
        supervised_finetune(model, lookups, steps=w.lookup_steps, lr=w.lr, rows=w.rows, seed=config.seed,
                            pad_id=pad, log_every=max(1, w.lookup_steps // 5))
    pairs = traces(world, search_prob=(w.search_prob_a, w.search_prob_b), copies=(w.known_copies, w.lookup_copies))
    searching = sum(len(segs) > 1 for _, segs in pairs) / len(pairs)
    print(f"warm start: {len(pairs)} traces ({100 * searching:.0f}% search), {w.steps} steps", flush=True)
    supervised_finetune(model, pairs, steps=w.steps, lr=w.lr, rows=w.rows, seed=config.seed, pad_id=pad,
                        log_every=max(1, w.steps // 10))
    return model
