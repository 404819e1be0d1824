"""Trajectories -> padded training arrays (next-token aligned)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sem_jax.sampling.rollout import Trajectory
from sem_jax.sampling.sampler import bucket_length


def batch_width(trajs: Sequence[Trajectory], min_length: int = 32) -> int:
    """T of `build_batch`: the longest prompt + response, bucketed (bounded recompiles)."""
    return bucket_length(max(len(t.prompt_ids) + len(t.response_ids) for t in trajs) - 1, minimum=min_length)


def build_batch(trajs: Sequence[Trajectory], advantages: np.ndarray, *, micro_batch: int,
                pad_id: int = 0, width: int | None = None) -> dict[str, np.ndarray]:
    """Arrays [N, T] with position t predicting token t+1 of prompt+response.

    `mask` is 1 exactly on targets the policy sampled (0 on prompt, inserted results and
    padding); rows are padded with all-zero-mask rows up to a multiple of `micro_batch`,
    and T is `width` (default `batch_width(trajs)`; processes agree on one).
    """
    seqs = [list(t.prompt_ids) + t.response_ids.tolist() for t in trajs]
    n = -(-len(seqs) // micro_batch) * micro_batch
    width = width or batch_width(trajs)
    if max(len(s) for s in seqs) - 1 > width:
        raise ValueError(f"a trajectory of {max(len(s) for s in seqs)} tokens does not fit width {width}")
    out = {
        "inputs": np.full((n, width), pad_id, np.int32),
        "targets": np.full((n, width), pad_id, np.int32),
        "mask": np.zeros((n, width), np.float32),
        "sampler_logprobs": np.zeros((n, width), np.float32),
        "advantages": np.zeros((n,), np.float32),
    }
    for i, (t, s) in enumerate(zip(trajs, seqs)):
        p, m = len(t.prompt_ids), len(s) - 1
        out["inputs"][i, :m] = s[:-1]
        out["targets"][i, :m] = s[1:]
        # Target index j is token j+1: response token r sits at target p - 1 + r.
        out["mask"][i, p - 1:m] = t.loss_mask
        out["sampler_logprobs"][i, p - 1:m] = t.logprobs
        out["advantages"][i] = advantages[i]
    return out
