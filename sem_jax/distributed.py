"""Multi-process start-up: `jax.distributed.initialize()` before anything touches a backend
(bm25s, imported lazily by the retriever, initialises XLA when imported)."""

from __future__ import annotations

import glob
import os

import jax

from sem_jax.config import Distributed


_started = False  # whether this process started the distributed runtime (`initialize`)


def started() -> bool:
    """Whether `initialize` started the distributed runtime: JAX then syncs preemption notices
    (SIGTERM) across processes, which orbax's `reached_preemption` reads."""
    return _started


def on_tpu_vm() -> bool:
    """TPU VMs expose their chips as /dev/accel* (v4) or /dev/vfio/* (v5e and later)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def initialize(cfg: Distributed) -> None:
    """`distributed.mode`: "auto" (initialise on a TPU VM, or when a coordinator is given),
    "on" or "off". A coordinator (GPU / CPU clusters) comes from the config or from
    JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID."""
    mode = cfg.mode
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"distributed.mode={mode!r}; choose auto, on or off")
    coordinator = cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if mode == "off" or (mode == "auto" and not coordinator and not on_tpu_vm()):
        return
    if cfg.cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    global _started
    _started = True
    if coordinator:
        num = cfg.num_processes if cfg.num_processes is not None else int(os.environ["JAX_NUM_PROCESSES"])
        pid = cfg.process_id if cfg.process_id is not None else int(os.environ["JAX_PROCESS_ID"])
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num, process_id=pid)
    else:
        jax.distributed.initialize()  # TPU VMs: hosts and ranks are discovered
