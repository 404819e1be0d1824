"""Host-local rows <-> global arrays, for runs with several processes (TPU pods, multi-node GPU).

Every process holds its own rows of each batch (its prompts, its trajectories) and calls the
same jitted functions, in the same order, with the same global shapes. This module is the one
place where local rows meet global arrays:

* `to_global` places each process's rows into one array sharded over the mesh's batch axes
  (`jax.make_array_from_process_local_data`); `to_local` reads this process's rows back.
* `agree_max` makes shape choices (bucketed widths, padded row counts) the same everywhere.
* `gather_json` collects small host-side records (metrics) from every process, as JSON.
* `CallLog` (debug): each process logs its device calls; `check` asserts they match.
* `check_shared_dir`: the run directory must be one that every process sees (checkpoints).

With one process every function is the plain single-host operation.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from sem_jax.sharding import batch_sharding, pieces


def batch_shards(mesh: Mesh) -> int:
    """How many ways the mesh splits a batch (its `batch` axes, e.g. data x fsdp)."""
    return pieces("batch", dict(mesh.shape))


def local_batch_multiple(mesh: Mesh) -> int:
    """A multiple of which each process's row count must be (its share of the batch shards)."""
    return max(1, batch_shards(mesh) // jax.process_count())


def agree_max(value: int) -> int:
    """The largest `value` over all processes (every process must call this)."""
    if jax.process_count() == 1:
        return int(value)
    return int(np.max(multihost_utils.process_allgather(np.array([value], np.int64))))


def agree_max_each(*values: int) -> tuple[int, ...]:
    """Each value's largest over all processes, in one exchange (every process must call this)."""
    if jax.process_count() == 1:
        return tuple(int(v) for v in values)
    got = multihost_utils.process_allgather(np.array(values, np.int64))
    return tuple(int(x) for x in np.max(np.asarray(got).reshape(-1, len(values)), axis=0))


def to_global(local: np.ndarray, mesh: Mesh) -> jax.Array:
    """One array whose rows are every process's `local` rows in process order (each process
    gives the same number), sharded over the mesh's batch axes."""
    local = np.asarray(local)
    shape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
    if jax.process_count() > 1 and shape[0] % batch_shards(mesh):
        raise ValueError(f"a global batch of {shape[0]} rows does not split over the mesh's "
                         f"{batch_shards(mesh)} batch shards (pad each process's rows to a multiple of "
                         f"{local_batch_multiple(mesh)})")
    return jax.make_array_from_process_local_data(batch_sharding(mesh, shape), local, shape)


def to_local(x: jax.Array) -> np.ndarray:
    """This process's rows of `x` (a batch-sharded array; a replicated one is returned whole)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    blocks: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:
        rows = shard.index[0] if shard.index else slice(None)
        blocks.setdefault(rows.start or 0, np.asarray(shard.data))
    starts = sorted(blocks)
    out = np.concatenate([blocks[s] for s in starts])
    if starts[-1] - starts[0] + len(blocks[starts[-1]]) != len(out):
        raise ValueError(f"rows of array {x.shape} on process {jax.process_index()} are not contiguous")
    return out


def gather_json(obj: Any) -> list[Any]:
    """`obj` (JSON-serialisable) from every process, in process order."""
    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    width = agree_max(len(data))
    padded = np.zeros(width + 8, np.uint8)
    padded[:8] = np.frombuffer(np.int64(len(data)).tobytes(), np.uint8)
    padded[8:8 + len(data)] = data
    everyone = np.asarray(multihost_utils.process_allgather(padded))
    out = []
    for row in everyone.reshape(jax.process_count(), -1):
        n = int(np.frombuffer(row[:8].tobytes(), np.int64)[0])
        out.append(json.loads(row[8:8 + n].tobytes().decode()))
    return out


def check_shared_dir(path: str) -> None:
    """Raise unless every process sees the files the others write in `path` (orbax writes
    each process's shards of a checkpoint into the same directory)."""
    if jax.process_count() == 1:
        return
    pid = jax.process_index()
    mark = lambda i: os.path.join(path, f".process{i}.alive")
    with open(mark(pid), "w") as fh:
        fh.write(socket.gethostname())
    gather_json(pid)  # a barrier: every process has written its mark
    missing = [i for i in range(jax.process_count()) if not os.path.exists(mark(i))]
    if missing:
        raise RuntimeError(f"run_dir {path} is not shared: process {pid} does not see the files of processes "
                           f"{missing}; put run_dir on storage every host mounts (tpu/pod.sh mount: a gcsfuse bucket)")


class CallLog:
    """Debug aid: every process records (name, shapes) of each device call it makes; `check`
    raises on any process whose sequence differs (a mismatch would otherwise hang a pod)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.calls: list[str] = []

    def record(self, name: str, *arrays: Any) -> None:
        if self.enabled:
            shapes = [tuple(np.shape(a)) for a in jax.tree.leaves(arrays)]
            self.calls.append(f"{name}{shapes}")

    def check(self, where: str) -> None:
        if not self.enabled:
            return
        digest = hashlib.sha256("\n".join(self.calls).encode()).hexdigest()
        everyone = gather_json([digest, self.calls[-3:]])
        if any(d != everyone[0][0] for d, _ in everyone):
            tails = "; ".join(f"process {i}: {calls}" for i, (_, calls) in enumerate(everyone))
            raise RuntimeError(f"{where}: processes made different device calls (last calls: {tails})")
        self.calls.clear()


__all__: Sequence[str] = ("batch_shards", "local_batch_multiple", "agree_max", "agree_max_each", "to_global", "to_local",
                          "gather_json", "check_shared_dir", "CallLog")
