"""Orbax checkpoints: params and optimizer state as separate items (export restores params
alone), plus a JSON item with step, data position and counters.

Orbax writes each step to a temporary directory and renames it when complete, so an
interrupted write never replaces the last good checkpoint; saves are asynchronous.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs with the arrays' shardings: restore lands straight in place."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpointer:
    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        self.manager = ocp.CheckpointManager(
            self.directory, item_names=("params", "opt_state", "meta"),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                 enable_async_checkpointing=async_save))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params: Any, opt_state: Any, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta)))

    def restore(self, step: int, params_like: Any, opt_like: Any) -> tuple[Any, Any, dict]:
        r = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_like(params_like)),
            opt_state=ocp.args.StandardRestore(abstract_like(opt_like)), meta=ocp.args.JsonRestore()))
        return r.params, r.opt_state, dict(r.meta)

    def restore_params(self, step: int | None, params_like: Any) -> tuple[Any, int]:
        """Parameters alone (no optimizer state read), from `step` or the latest."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{self.directory}: no checkpoint")
        r = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_like(params_like))))
        return r.params, step

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
