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
