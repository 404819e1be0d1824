"""A step's calls as abstract programs (no memory): the target's devices and HBM, the sampler's
per-layer copies, the per-device bytes of placed trees, and what XLA counts for a compiled
program (the abstract model itself is `sem_jax.assemble.abstract_model`, built for a compile-only
run by `assemble.build_compile`). The fit check (`aot`), the roofline and the measured runs (`measure`)
start here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sem_jax.aot.collectives import ici_bytes
from sem_jax.kernels import flash_attention
from sem_jax.kernels.dispatch import per_layer_default
from sem_jax.sampling.sampler import layer_list
from sem_jax.config import Config
from sem_jax.sharding import batch_sharding

# HBM per device as the TPU compiler sees a compile-only topology device: one TensorCore.
# (v4 and v5p chips hold two TensorCores; in megacore mode a chip is one device with twice
# this, so the check is conservative there.)
HBM_GIB = {"TPU v4": 16.0, "TPU v5 lite": 16.0, "TPU v5": 47.5, "TPU v6 lite": 32.0}


def target_devices(topology: str | None) -> list:
    if not topology:
        return jax.devices()
    from jax.experimental import topologies
    try:
        devices = list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    except Exception as e:  # noqa: BLE001 - libtpu missing or a bad name: say which
        raise RuntimeError(f"cannot build TPU topology {topology!r} ({type(e).__name__}: {e}); "
                           "is jax[tpu] (libtpu) installed?") from None
    # The description lists every TensorCore; v4 and v5p run one device per chip (megacore).
    return [d for d in devices if getattr(d, "core_on_chip", 0) == 0]


def hbm_per_device(devices: list, override_gib: float | None) -> float:
    if override_gib:
        return override_gib * 2**30
    kind = devices[0].device_kind
    if kind not in HBM_GIB:
        raise ValueError(f"unknown HBM size for device kind {kind!r}: pass --hbm_gib")
    return HBM_GIB[kind] * 2**30


def narrower(a, b) -> jnp.dtype:
    """The narrower of two float dtypes (the sampler's weights: `compute_weights`)."""
    a, b = jnp.dtype(a), jnp.dtype(b)
    return b if b.itemsize < a.itemsize else a


def sampler_layers(graphdef, params, platform: str):
    """The per-layer weights a sampler on `platform` holds beside `params` (`Sampler.per_layer`),
    abstract and placed as `sem_jax.sampling.sampler.layer_list` places them; None where it runs
    the layer scan."""
    if not per_layer_default(sampler=True, platform=platform):
        return None
    return placed(jax.eval_shape(layer_list, graphdef, params), layer_list.lower(graphdef, params).compile()
                     .output_shardings)


def placed(tree, shardings):
    """Abstract arrays of `tree`'s shapes and dtypes with `shardings`."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, shardings)


def device_bytes(tree) -> int:
    """Bytes per device of a tree of sharded abstract arrays (the largest shard's)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def trainer_bytes(params, opt, config: Config, base=None) -> int:
    """What the trainer holds per device between its calls (beside the rollout): the parameters,
    the optimizer state and, with rl.beta > 0, the reference weights in the compute dtype; with
    LoRA (`params` the adapters) the frozen `base`, which is the reference too."""
    if base is not None:
        return device_bytes(base) + device_bytes(params) + device_bytes(opt)
    ref = 0
    if config.rl.beta > 0:
        dtype, compute = jnp.dtype(config.model.dtype), jnp.dtype(config.model.compute_dtype)
        ref = device_bytes(params) * narrower(dtype, compute).itemsize // dtype.itemsize
    return device_bytes(params) + device_bytes(opt) + ref


def rows_on(mesh):
    """Abstract row-sharded arrays on `mesh`: `arr(shape, dtype)`."""
    return lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=batch_sharding(mesh, shape))


def cost(compiled) -> dict[str, float]:
    """XLA's FLOPs and bytes of a compiled program, with the splash kernels' own estimates (XLA
    counts none for them), and the bytes each device sends in its collectives (`ici`)."""
    c = compiled.cost_analysis()
    c = (c[0] if isinstance(c, (list, tuple)) else c) or {}
    text = compiled.as_text()
    kernels = flash_attention.hlo_cost(text)
    return {"flops": float(c.get("flops", 0.0)) + kernels["flops"],
            "bytes": float(c.get("bytes accessed", 0.0)) + kernels["bytes"], "ici": ici_bytes(text)}


@dataclasses.dataclass(frozen=True)
class Filled:
    """An integer argument with one value throughout (a length, a count, a window's start)."""
    like: jax.ShapeDtypeStruct
    value: int


@dataclasses.dataclass
class Program:
    """One call as a GRPO step makes it."""
    fn: Callable                  # the jitted function (static arguments passed as the step passes them)
    args: tuple                   # abstract arrays (ShapeDtypeStruct leaves), None, or static values
    kwargs: dict
    mesh: Any                     # the mesh the call runs under (`jax.set_mesh`)
    state_from: dict[int, str] = dataclasses.field(default_factory=dict)  # argument -> the program whose output it is
    donated: tuple[int, ...] = ()  # arguments the call consumes: a fresh copy for each run
    steps: int = 1                # the roofline's units per call (decode steps per loop)
    check: Callable | None = None  # output -> an error text, or None: that the call did its whole work
