"""Orbax checkpoints: params and optimizer state as separate items (export restores params
alone), plus a JSON item with step, data position and counters.

Orbax writes each step to a temporary directory and renames it when complete, so an
interrupted write never replaces the last good checkpoint; saves are asynchronous.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs with the arrays' shardings: restore lands straight in place."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpointer:
    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True, read_only: bool = False):
        """`read_only` (evaluation, export): the directory must exist, and nothing is created."""
        self.directory = os.path.abspath(directory)
        if read_only and not os.path.isdir(self.directory):
            raise FileNotFoundError(f"{self.directory}: no checkpoint directory there (a run's is run_dir/ckpt)")
        self.manager = ocp.CheckpointManager(
            self.directory, item_names=("params", "opt_state", "meta"),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                                 enable_async_checkpointing=async_save))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params: Any, opt_state: Any, meta: dict) -> None:
        """Start writing `step` (in the background when async). Refused at once, with the free space,
        when the disk cannot hold it: the checkpoints already there are kept either way."""
        self.check()
        need = sum(x.nbytes for x in jax.tree.leaves((params, opt_state)) if hasattr(x, "nbytes"))
        need //= jax.process_count()  # each process writes its shards
        free = shutil.disk_usage(self.directory).free
        if free < need * 1.05 + (64 << 20):
            raise OSError(errno.ENOSPC, f"{self.directory}: {free / 2**30:.2f} GiB free, a checkpoint needs about "
                          f"{need / 2**30:.2f} GiB; not saving step {step} (the last checkpoint, step "
                          f"{self.latest_step()}, is kept)")
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta)))

    def restore(self, step: int, params_like: Any, opt_like: Any) -> tuple[Any, Any, dict]:
        r = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_like(params_like)),
            opt_state=ocp.args.StandardRestore(abstract_like(opt_like)), meta=ocp.args.JsonRestore()))
        return r.params, r.opt_state, dict(r.meta)

    def restore_newest(self, params_like: Any, opt_like: Any) -> tuple[int, Any, Any, dict] | None:
        """(step, params, opt_state, meta) of the newest checkpoint that restores, or None when
        there is none. Newer ones that fail to restore (a truncated or missing file) are moved
        aside to `N.unreadable`, kept for inspection, and said so. When none restores (more
        likely a config that no longer matches them than damage to all), nothing is moved and
        the newest one's error is raised."""
        failed: list[tuple[int, Exception]] = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                restored = (step, *self.restore(step, params_like, opt_like))
            except Exception as e:  # noqa: BLE001 - whatever a damaged step raises (TensorStore, OSError, KeyError)
                failed.append((step, e))
                continue
            for bad, error in failed:
                self._set_aside(bad, error)
            return restored
        if failed:
            step, error = failed[0]
            raise RuntimeError(f"{self.directory}: no checkpoint restores (steps {[s for s, _ in failed]}); step "
                               f"{step}: {type(error).__name__}: {str(error)[:300]}. If the model or optimizer "
                               "config changed since they were written, train in a new run_dir") from error
        return None

    def _set_aside(self, step: int, error: Exception) -> None:
        src = os.path.join(self.directory, str(step))
        dst = f"{src}.unreadable"
        if jax.process_index() == 0:
            n = 1
            while os.path.exists(dst):
                dst, n = f"{src}.unreadable{n}", n + 1
            os.rename(src, dst)
        print(f"checkpoint step {step} does not restore ({type(error).__name__}: {str(error)[:300]}); "
              f"moved it to {dst}, resuming from an earlier step", flush=True)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"set aside checkpoint {step}")
        self.manager.reload()

    def restore_params(self, step: int | None, params_like: Any) -> tuple[Any, int]:
        """Parameters alone (no optimizer state read), from `step` or the latest."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{self.directory}: no checkpoint")
        r = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_like(params_like))))
        return r.params, step

    def check(self) -> None:
        """Raise now if a background save failed (a full disk mid-write, a lost mount), naming the
        directory and its free space, rather than one save interval later."""
        try:
            self.manager.check_for_errors()
        except Exception as e:  # noqa: BLE001 - orbax re-raises whatever the writer thread hit
            raise self._save_failed(e) from e

    def _save_failed(self, e: Exception) -> OSError:
        free = shutil.disk_usage(self.directory).free
        return OSError(f"{self.directory}: a checkpoint save failed ({type(e).__name__}: {e}); {free / 2**30:.2f} "
                       f"GiB free there; the last complete checkpoint is step {self.latest_step()}")

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Wait for the save in flight (raising its failure as `check` does), then close."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - the background save's own error
            raise self._save_failed(e) from e
        self.manager.close()
