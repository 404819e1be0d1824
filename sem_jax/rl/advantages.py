"""Group-relative advantages (GRPO)."""

from __future__ import annotations

import numpy as np


def group_advantages(rewards: np.ndarray, group_size: int, *, eps: float = 1e-6,
                     scale_by_std: bool = True) -> np.ndarray:
    """(r - mean(group)) / (std(group) + eps) for rows laid out as prompt * G + g.

    With `scale_by_std=False` (Dr. GRPO) only the group mean is removed.
    """
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1 or r.size % group_size:
        raise ValueError(f"rewards of shape {r.shape} do not split into groups of {group_size}")
    g = r.reshape(-1, group_size)
    adv = g - g.mean(axis=1, keepdims=True)
    if scale_by_std:
        adv = adv / (g.std(axis=1, keepdims=True) + eps)
    return adv.reshape(-1).astype(np.float32)


def tied_groups(rewards: np.ndarray, group_size: int) -> int:
    """Groups whose G rewards are all equal: their advantages are 0, so they teach nothing."""
    g = np.asarray(rewards, np.float64).reshape(-1, group_size)
    return int((g.max(axis=1) == g.min(axis=1)).sum())
