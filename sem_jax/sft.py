"""Supervised warm start: teach a policy the answer-first format from (prompt, response) pairs.

Cross-entropy on response tokens only; segments marked as inserted (retrieval results)
are in the context but get no loss, exactly as in GRPO.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sem_jax.model.qwen2 import Qwen2
from sem_jax.rl.loss import token_logprobs
from sem_jax.sampling.sampler import bucket_length

# A training pair: prompt ids, and response segments (ids, trained?).
Pair = tuple[list[int], list[tuple[list[int], bool]]]


def pack(pairs: Sequence[Pair], pad_id: int = 0) -> dict[str, np.ndarray]:
    """Next-token aligned arrays with the loss mask on trained response segments."""
    seqs, masks = [], []
    for prompt, segments in pairs:
        ids, mask = list(prompt), [0] * len(prompt)
        for seg, trained in segments:
            ids += seg
            mask += [int(trained)] * len(seg)
        seqs.append(ids)
        masks.append(mask)
    width = bucket_length(max(len(s) for s in seqs) - 1, minimum=16)
    out = {"inputs": np.full((len(seqs), width), pad_id, np.int32),
           "targets": np.full((len(seqs), width), pad_id, np.int32),
           "mask": np.zeros((len(seqs), width), np.float32)}
    for i, (s, m) in enumerate(zip(seqs, masks)):
        out["inputs"][i, :len(s) - 1] = s[:-1]
        out["targets"][i, :len(s) - 1] = s[1:]
        out["mask"][i, :len(s) - 1] = m[1:]
    return out


def supervised_finetune(model: Qwen2, pairs: Sequence[Pair], *, steps: int, lr: float = 3e-3,
                        batch_size: int = 16, seed: int = 0, pad_id: int = 0,
                        log_every: int = 0) -> list[float]:
    """Train `model` in place with AdamW on `pairs`; returns the loss per step."""
    graphdef, params = nnx.split(model)
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), steps), weight_decay=0.0)
    opt_state = tx.init(params)
    data = pack(pairs, pad_id)

    @jax.jit
    def step(params, opt_state, batch):
        def loss_fn(p):
            lp, _ = token_logprobs(nnx.merge(graphdef, p), batch["inputs"], batch["targets"], chunk=16)
            return -jnp.sum(lp * batch["mask"]) / jnp.maximum(batch["mask"].sum(), 1.0)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.RandomState(seed)
    losses = []
    for i in range(steps):
        idx = rng.choice(len(pairs), size=min(batch_size, len(pairs)), replace=False)
        params, opt_state, loss = step(params, opt_state, {k: v[idx] for k, v in data.items()})
        losses.append(float(loss))
        if log_every and (i + 1) % log_every == 0:
            print(f"[sft {i + 1}/{steps}] loss={losses[-1]:.4f}", flush=True)
    nnx.update(model, params)
    return losses
