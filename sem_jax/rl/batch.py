"""Trajectories -> padded training arrays (next-token aligned)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sem_jax.sampling.rollout import Trajectory
from sem_jax.sampling.sampler import bucket_length


def batch_width(trajs: Sequence[Trajectory], min_length: int = 32) -> int:
    """T of `build_batch`: the longest prompt + response, bucketed (bounded recompiles)."""
    return bucket_length(max(len(t.prompt_ids) + len(t.response_ids) for t in trajs) - 1, minimum=min_length)


def response_width(trajs: Sequence[Trajectory], min_length: int = 32) -> int:
    """R of `build_batch`: the longest response, bucketed like T (so R <= T)."""
    return bucket_length(max(len(t.response_ids) for t in trajs), minimum=min_length)


def batch_shapes(rows: int, width: int, response: int) -> dict[str, tuple[tuple[int, ...], type]]:
    """Each array of a `build_batch` batch: (shape, dtype) for `rows` rows of width T and a
    response window of R."""
    return {"inputs": ((rows, width), np.int32), "start": ((rows,), np.int32),
            "targets": ((rows, response), np.int32), "mask": ((rows, response), np.float32),
            "sampler_logprobs": ((rows, response), np.float32), "advantages": ((rows,), np.float32)}


def widest_batch(rows: int, max_prompt_tokens: int, response_tokens: int) -> dict[str, tuple[tuple[int, ...], type]]:
    """`batch_shapes` of the widest batch `build_batch` makes from prompts of at most
    `max_prompt_tokens` and responses of at most `response_tokens` (sampled and inserted), bucketed
    as `batch_width` and `response_width` bucket them: what a compile-only check sizes for."""
    return batch_shapes(rows, bucket_length(max_prompt_tokens + response_tokens - 1, minimum=32),
                        bucket_length(response_tokens, minimum=32))


def build_batch(trajs: Sequence[Trajectory], advantages: np.ndarray, *, micro_batch: int,
                pad_id: int = 0, width: int | None = None, response: int | None = None,
                group_size: int = 1) -> dict[str, np.ndarray]:
    """Training arrays: `inputs` [N, T] (prompt + response), and a response window of R
    targets per row: `targets`, `mask`, `sampler_logprobs` [N, R], where target j of row i is
    the token after input position `start[i] + j` (see `token_logprobs`).

    `mask` is 1 exactly on targets the policy sampled (0 on the prompt, inserted results and
    padding); rows are padded with all-zero-mask rows up to a multiple of `micro_batch`. T is
    `width` (default `batch_width(trajs)`), R is `response` (default `response_width(trajs)`);
    processes agree on both.

    `group_size`: trajectories come in groups of this many consecutive ones with the same
    prompt (the rollout's order), which `Trainer(group_size=)` computes once per group;
    anything else is a `ValueError` naming the row.

    `resid` [N, T, E] float32 when every trajectory carries the residual stream the sampler kept
    (`Trajectory.resid`): input position j's, where a LoRA update starts (0 on padding).
    """
    if len(trajs) % group_size:
        raise ValueError(f"{len(trajs)} trajectories do not split into groups of {group_size}")
    for i, t in enumerate(trajs):
        if list(t.prompt_ids) != list(trajs[i - i % group_size].prompt_ids):
            raise ValueError(f"trajectory {i} has another prompt than trajectory {i - i % group_size}, "
                             f"the first of its group of {group_size}")
    seqs = [list(t.prompt_ids) + t.response_ids.tolist() for t in trajs]
    n = -(-len(seqs) // micro_batch) * micro_batch
    width = width or batch_width(trajs)
    response = response or response_width(trajs)
    if max(len(s) for s in seqs) - 1 > width:
        raise ValueError(f"a trajectory of {max(len(s) for s in seqs)} tokens does not fit width {width}")
    longest = max(len(t.response_ids) for t in trajs)
    if longest > response or response > width:
        raise ValueError(f"responses of up to {longest} tokens do not fit a response window of {response} "
                         f"in width {width}")
    out = {k: np.full(shape, pad_id if k in ("inputs", "targets") else 0, dtype)
           for k, (shape, dtype) in batch_shapes(n, width, response).items()}
    if all(t.resid is not None for t in trajs):
        out["resid"] = np.zeros((n, width, trajs[0].resid.shape[-1]), np.float32)
    for i, (t, s) in enumerate(zip(trajs, seqs)):
        p, m = len(t.prompt_ids), len(s) - 1
        out["inputs"][i, :m] = s[:-1]
        # Input position j predicts token j+1: response token r follows position p - 1 + r. A long
        # prompt with a short response shifts the window left (those targets are prompt, mask 0).
        start = min(p - 1, width - response)
        end = min(start + response, m)
        out["start"][i] = start
        out["targets"][i, :end - start] = s[start + 1:end + 1]
        out["mask"][i, p - 1 - start:m - start] = t.loss_mask
        out["sampler_logprobs"][i, p - 1 - start:m - start] = t.logprobs
        out["advantages"][i] = advantages[i]
        if "resid" in out:
            out["resid"][i, :m] = t.resid[:m]
    return out
