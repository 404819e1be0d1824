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

from sem_jax.errors import Refused

log = logging.getLogger(__name__)


class CheckpointMismatch(Refused):
    """A checkpoint written by another model or optimizer config (a tensor missing, extra or of
    another shape): nothing is restored or moved."""


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """Each leaf's shape by its dotted path ("embed.value", "1.0.mu.embed.value")."""
    def name(k):
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)
    return {".".join(name(k) for k in path): tuple(getattr(x, "shape", ()))
            for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def checkpoint_run_dir(checkpoint: str) -> str:
    """The run directory that holds `checkpoint` (run_dir/ckpt)."""
    return os.path.dirname(os.path.abspath(checkpoint.rstrip("/")))


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs with the arrays' shardings: restore lands straight in place."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpointer:
    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True, read_only: bool = False):
        """`read_only` (evaluation, export): the directory must exist, and nothing is created."""
        self.directory = os.path.abspath(directory)
        if read_only and not os.path.isdir(self.directory):
            raise FileNotFoundError(f"{self.directory}: no checkpoint directory there (a run's is run_dir/ckpt)")
        # Handlers named up front: the stored shapes can then be read before a restore (`mismatch`).
        self.manager = ocp.CheckpointManager(
            self.directory, item_handlers={"params": ocp.StandardCheckpointHandler(),
                                           "opt_state": ocp.StandardCheckpointHandler(),
                                           "meta": ocp.JsonCheckpointHandler()},
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
        try:  # orbax first waits for the save before, and raises its failure here
            self.manager.save(step, args=ocp.args.Composite(
                params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
                meta=ocp.args.JsonSave(meta)))
        except Exception as e:  # noqa: BLE001 - whatever the writer hit (OSError, TensorStore's ValueError)
            raise self._save_failed(e) from e

    def restore(self, step: int, params_like: Any, opt_like: Any) -> tuple[Any, Any, dict]:
        r = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_like(params_like)),
            opt_state=ocp.args.StandardRestore(abstract_like(opt_like)), meta=ocp.args.JsonRestore()))
        return r.params, r.opt_state, dict(r.meta)

    def mismatch(self, step: int, **items: Any) -> str | None:
        """How `step`'s stored tensors differ from `items` (params=..., opt_state=...) by shape,
        naming the first tensor that differs, is missing or is extra; None when all match. Reads
        the checkpoint's metadata only (raises when that is damaged)."""
        stored_items = self.manager.item_metadata(step)
        for item, like in items.items():
            stored, want = _shapes(stored_items[item]) if stored_items[item] is not None else {}, _shapes(like)
            if not stored:
                raise FileNotFoundError(f"{self.directory}/{step}/{item}: no tensor metadata readable there")
            for name, shape in want.items():
                if name not in stored:
                    return f"{item}.{name} {shape} is not in the checkpoint"
                if stored[name] != shape:
                    return f"{item}.{name} is {stored[name]} in the checkpoint, {shape} in this config"
            extra = sorted(stored.keys() - want.keys())
            if extra:
                return f"the checkpoint holds {len(extra)} {item} tensors this config has not, first {item}.{extra[0]}"
        return None

    def _refuse_mismatch(self, step: int, differs: str) -> CheckpointMismatch:
        return CheckpointMismatch(
            f"{self.directory}: step {step} was written by another model or optimizer config: {differs}. Nothing "
            "was restored or changed; use the config it was trained with (run_dir/config.json), or a new run_dir")

    def restore_newest(self, params_like: Any, opt_like: Any) -> tuple[int, Any, Any, dict] | None:
        """(step, params, opt_state, meta) of the newest checkpoint that restores, or None when
        there is none. A checkpoint whose tensors differ from the config's by shape is refused
        (`CheckpointMismatch`): the config changed, not the files. Newer ones that fail to
        restore (a truncated, missing or corrupted file) are moved aside to `N.unreadable`, kept
        for inspection, and said so. When none restores, nothing is moved and the newest one's
        error is raised."""
        failed: list[tuple[int, Exception]] = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                differs = self.mismatch(step, params=params_like, opt_state=opt_like)
            except Exception as e:  # noqa: BLE001 - damaged metadata
                failed.append((step, e))
                continue
            if differs:
                raise self._refuse_mismatch(step, differs)
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
            raise RuntimeError(f"{self.directory}: no checkpoint restores (steps {[s for s, _ in failed]}), though "
                               f"their tensors' shapes match this config: their files are damaged; step {step}: "
                               f"{type(error).__name__}: {str(error)[:300]}") from error
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
        steps = sorted(self.manager.all_steps())
        step = (steps[-1] if steps else None) if step is None else step
        if step is None:
            raise FileNotFoundError(f"{self.directory}: no checkpoint")
        if step not in steps:
            raise FileNotFoundError(f"{self.directory}: no step {step} (the steps there: {steps})")
        try:
            differs = self.mismatch(step, params=params_like)
        except Exception as e:  # noqa: BLE001 - damaged metadata
            raise self._damaged(step, e) from None
        if differs:
            raise self._refuse_mismatch(step, differs)
        try:
            r = self.manager.restore(step, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract_like(params_like))))
        except Exception as e:  # noqa: BLE001 - whatever a damaged step raises (TensorStore, OSError, KeyError)
            raise self._damaged(step, e) from None
        return r.params, step

    def _damaged(self, step: int, error: Exception) -> RuntimeError:
        said = str(error).splitlines()[0][:300] if str(error) else ""
        return RuntimeError(f"{self.directory}: step {step} is there but does not restore ({type(error).__name__}: "
                            f"{said}); if its files are damaged, evaluate or export another step (--step)")

    def restore_meta(self, step: int) -> dict:
        """`step`'s metadata alone (its step count, data position, a LoRA run's base fingerprint)."""
        return dict(self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)

    def check(self) -> None:
        """Raise now if a background save failed (a full disk mid-write, a lost mount), naming the
        directory and its free space, rather than one save interval later."""
        try:
            self.manager.check_for_errors()
        except Exception as e:  # noqa: BLE001 - orbax re-raises whatever the writer thread hit
            raise self._save_failed(e) from e

    def _save_failed(self, e: Exception) -> OSError:
        free, last = shutil.disk_usage(self.directory).free, self.latest_step()
        return OSError(f"{self.directory}: a checkpoint save failed ({type(e).__name__}: {e}); {free / 2**30:.2f} "
                       f"GiB free there; the last complete checkpoint is "
                       + (f"step {last}" if last is not None else "none yet (no step saved)"))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Wait for the save in flight (raising its failure as `check` does), then close."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - the background save's own error
            raise self._save_failed(e) from e
        self.manager.close()
