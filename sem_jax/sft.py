"""Supervised warm start: teach a policy the answer-first format from (prompt, response) pairs.

Cross-entropy on response tokens only; segments marked as inserted (retrieval results)
are in the context but get no loss, exactly as in GRPO.
"""

from __future__ import annotations

import time
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


def pack(pairs: Sequence[Pair], width: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Pairs packed first-fit, in order, into rows of `width` next-token slots: inputs,
    targets, loss mask (trained response segments) and segment ids (1, 2, ... per pair in a
    row; 0 is padding), so that no pair sees another (`Qwen2.hidden_states(segment_ids=)`)."""
    rows: list[list[tuple[list[int], list[int]]]] = [[]]
    used = 0
    for n, (prompt, segments) in enumerate(pairs):
        ids, mask = list(prompt), [0] * len(prompt)
        for seg, trained in segments:
            ids += seg
            mask += [int(trained)] * len(seg)
        if len(ids) - 1 > width:
            raise ValueError(f"pair {n}: {len(ids)} tokens do not fit a packed row of {width} + 1")
        if used + len(ids) - 1 > width:
            rows.append([])
            used = 0
        rows[-1].append((ids, mask))
        used += len(ids) - 1
    out = {"inputs": np.full((len(rows), width), pad_id, np.int32),
           "targets": np.full((len(rows), width), pad_id, np.int32),
           "mask": np.zeros((len(rows), width), np.float32),
           "segment_ids": np.zeros((len(rows), width), np.int32)}
    for r, row in enumerate(rows):
        at = 0
        for k, (ids, mask) in enumerate(row, start=1):
            n = len(ids) - 1
            out["inputs"][r, at:at + n] = ids[:-1]
            out["targets"][r, at:at + n] = ids[1:]
            out["mask"][r, at:at + n] = mask[1:]
            out["segment_ids"][r, at:at + n] = k
            at += n
    return out


def copy_pairs(token_ids: Sequence[int], count: int, seed: int, lengths: tuple[int, int] = (4, 19)) -> list[Pair]:
    """`count` strings of random tokens (`lengths` inclusive), each followed by itself with only
    the repeat trained: the copying ("induction") that pretraining gives a real model and that
    looking something up needs (a name from the question into the query, an answer out of a
    passage). A random-init model learns it here in a few hundred steps, and not from the
    lookup traces in as many."""
    rng = np.random.RandomState(seed)
    ids = np.asarray(token_ids)
    out = []
    for _ in range(count):
        x = ids[rng.randint(len(ids), size=rng.randint(lengths[0], lengths[1] + 1))].tolist()
        out.append(([], [(x, False), (x, True)]))
    return out


def packed_batches(pairs: Sequence[Pair], steps: int, rows: int, width: int, seed: int,
                   pad_id: int = 0):
    """`steps` packed batches of exactly `rows` rows, walking seeded permutations of `pairs`
    (each epoch in a new order; a batch takes pairs until its rows are full)."""
    rng = np.random.RandomState(seed)
    slots = [len(p) + sum(len(s) for s, _ in segs) - 1 for p, segs in pairs]
    order: list[int] = []
    for _ in range(steps):
        taken: list[int] = []
        row, used = 1, 0
        while True:
            if not order:
                order = list(rng.permutation(len(pairs)))
            n = slots[order[0]]
            if used + n > width:
                row, used = row + 1, 0
            if row > rows:
                break
            used += n
            taken.append(order.pop(0))
        batch = pack([pairs[i] for i in taken], width, pad_id)
        pad = rows - len(batch["inputs"])
        yield {k: np.pad(v, ((0, pad), (0, 0)), constant_values=pad_id if k in ("inputs", "targets") else 0)
               for k, v in batch.items()}


def supervised_finetune(model: Qwen2, pairs: Sequence[Pair], *, steps: int, lr: float = 3e-3,
                        rows: int = 12, width: int | None = None, seed: int = 0, pad_id: int = 0,
                        log_every: int = 0) -> list[float]:
    """Train `model` in place with AdamW (warmup, cosine decay) on `pairs`, packed into
    `rows` x `width` token batches (width: the longest pair, bucketed, at least 256);
    returns the loss per step."""
    graphdef, params = nnx.split(model)
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), steps), weight_decay=0.0)
    opt_state = tx.init(params)
    longest = max(len(p) + sum(len(s) for s, _ in segs) for p, segs in pairs)
    width = width or max(256, bucket_length(longest - 1, minimum=16))

    @jax.jit
    def step(params, opt_state, batch):
        def loss_fn(p):
            lp, _ = token_logprobs(nnx.merge(graphdef, p), batch["inputs"], batch["targets"], chunk=128,
                                   segment_ids=batch["segment_ids"])
            return -jnp.sum(lp * batch["mask"]) / jnp.maximum(batch["mask"].sum(), 1.0)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    t0 = time.perf_counter()
    for i, batch in enumerate(packed_batches(pairs, steps, rows, width, seed, pad_id)):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
        if log_every and ((i + 1) % log_every == 0 or i + 1 == steps):
            print(f"[warm start {i + 1}/{steps}] loss={np.mean(losses[-log_every:]):.4f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    nnx.update(model, params)
    return losses
