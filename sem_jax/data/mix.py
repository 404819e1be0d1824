"""The SEM training mix: MuSiQue (needs retrieval) and MMLU (known), balanced and shuffled."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sem_jax.data.example import Example


def sem_mix(needs_search: Sequence[Example], known: Sequence[Example], *, ratio: float = 1.0,
            seed: int = 0, limit: int | None = None) -> list[Example]:
    """`ratio` needs-search questions per known one (default 1:1), as many as the smaller side
    allows (or `limit` in all), shuffled with `seed`: the same seed gives the same order."""
    if ratio <= 0:
        raise ValueError(f"ratio must be > 0, got {ratio}")
    rng = np.random.RandomState(seed)
    n_known = min(len(known), int(len(needs_search) / ratio))
    if limit:
        n_known = min(n_known, int(limit / (1 + ratio)))
    n_search = int(round(n_known * ratio))
    pick_s = rng.permutation(len(needs_search))[:n_search]
    pick_k = rng.permutation(len(known))[:n_known]
    mixed = [needs_search[i] for i in pick_s] + [known[i] for i in pick_k]
    return [mixed[i] for i in rng.permutation(len(mixed))]


def process_share(examples: Sequence[Example], index: int, count: int) -> list[Example]:
    """This process's rows (every `count`-th from `index`): disjoint shares covering the set."""
    if not 0 <= index < count:
        raise ValueError(f"process index {index} not in [0, {count})")
    return list(examples[index::count])


def stratified_sample(examples: Sequence[Example], n: int, seed: int = 0) -> list[Example]:
    """`n` examples drawn at random with `seed`, each category (MMLU's subject, MuSiQue's hop
    count) holding its share of the set, rounded by largest remainder; in the set's order. A set
    sorted by subject is then sampled across subjects, not cut after the first few. All of them
    when `n` is not below the set's size."""
    if n < 1:
        raise ValueError(f"sample size must be >= 1, got {n}")
    if n >= len(examples):
        return list(examples)
    rng = np.random.RandomState(seed)
    groups: dict[str, list[int]] = {}
    for i, ex in enumerate(examples):
        groups.setdefault(ex.category, []).append(i)
    names = sorted(groups)
    exact = np.array([n * len(groups[c]) / len(examples) for c in names])
    quota = np.floor(exact).astype(int)
    # The seats left go to the largest remainders; equal remainders in a seeded random order.
    order = sorted(range(len(names)), key=lambda j: (-(exact[j] - quota[j]), rng.random_sample()))
    for j in order[:n - int(quota.sum())]:
        quota[j] += 1
    chosen = [i for c, q in zip(names, quota) for i in rng.choice(groups[c], size=q, replace=False)]
    return [examples[i] for i in sorted(chosen)]
