"""Logical axis names -> mesh axes, in one table.

Model code names the *logical* axes of every parameter and activation
(`embed`, `heads`, ...). This module alone knows the mesh axes (`data`, `fsdp`,
`tensor`) and how logical names map onto them.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
# The sampler's spread layout names its group axis `groups` (`tensor_groups(spread=True)`): the rows
# are split over it as over `data`, and the MLP's and LM head's weights too (see RULES).
SPREAD_AXES = ("groups", "fsdp", "tensor")
# Auto axes: GSPMD propagates shardings; Explicit (the default of make_mesh) would reject the
# gathers and einsums this model writes in plain jnp.
AXIS_TYPES = (AxisType.Auto,) * len(MESH_AXES)

# The one rules table. Parameters: `embed` is sharded by FSDP, the wide axes
# (heads, mlp, vocab) by tensor parallelism. Activations use their own names
# (`act_*`) so that a parameter's FSDP axis is not forced onto activations,
# whose batch axis already carries `data` and `fsdp`. On a mesh with a `groups` axis (the
# sampler's spread layout) the MLP's and the LM head's weights are split over the groups as well
# as tensor, and the rows meeting them (`spread_rows`, where the model gathers them: a decode
# step, the LM head on each row's last token) are whole on every group: each device reads
# 1/(groups x tensor) of those weights, and the rows, far fewer bytes, cross the interconnect
# instead (a 2-D weight-stationary layout).
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp", "groups")),
    ("spread_rows", ("data", "fsdp")),
    ("length", None),
    ("cache_length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", ("tensor", "groups")),
    ("act_vocab", "tensor"),
    ("act_head_vocab", ("tensor", "groups")),
    ("vocab", "tensor"),
    ("head_vocab", ("tensor", "groups")),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", ("tensor", "groups")),
    ("layers", None),
)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (`data`, `fsdp`, `tensor`) mesh; one size may be -1 (the remaining devices)."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got data={data} fsdp={fsdp} tensor={tensor}")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices do not divide by data*fsdp*tensor={known}")
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"mesh data={sizes[0]} fsdp={sizes[1]} tensor={sizes[2]} needs "
                         f"{int(np.prod(sizes))} devices, have {len(devices)}")
    return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=AXIS_TYPES, devices=devices)


def tensor_groups(mesh: Mesh, tensor: int, spread: bool = False) -> Mesh:
    """`mesh`'s devices as a (data, 1, `tensor`) mesh: groups of `tensor` devices, each group one
    process's consecutive devices (its rows then stay on its own devices, `sem_jax.hosts`), which
    hold the weights whole between them, split by tensor parallelism (the sampler's layout).
    `spread`: the group axis is `groups` (SPREAD_AXES), over which the MLP's and LM head's weights
    are split too."""
    devices = sorted(mesh.devices.flat, key=lambda d: (d.process_index, d.id))
    if tensor < 1 or len(devices) % tensor:
        raise ValueError(f"rollout.tensor={tensor} must be >= 1 and divide the {len(devices)} devices")
    per_process = collections.Counter(d.process_index for d in devices)
    if any(n % tensor for n in per_process.values()):
        raise ValueError(f"rollout.tensor={tensor} must divide each process's devices "
                         f"({sorted(set(per_process.values()))}): a tensor group cannot span processes")
    grid = np.array(devices, dtype=object).reshape(len(devices) // tensor, 1, tensor)
    return Mesh(grid, SPREAD_AXES if spread else MESH_AXES, axis_types=AXIS_TYPES)


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int] | None = None,
                    mesh_shape: dict[str, int] | None = None, rules=RULES) -> PartitionSpec:
    """PartitionSpec for logical `names`.

    With `mesh_shape`, mesh axes it lacks (or of size 1) are left out; with `shape` too, a
    dimension is split over the longest leading run of its axes that divides it (replicated
    where none does: 2 KV heads on a tensor axis of 4), and a mesh axis is used at most once
    per array.
    """
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for i, name in enumerate(names):
        if name is not None and name not in table:
            raise KeyError(f"logical axis {name!r} has no entry in the sharding rules")
        axes = table.get(name) if name is not None else None
        if axes is None:
            spec.append(None)
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        if mesh_shape is not None:
            axes = tuple(a for a in axes if a in mesh_shape and mesh_shape[a] > 1 and a not in used)
            while shape is not None and axes and shape[i] % int(np.prod([mesh_shape[a] for a in axes])):
                axes = axes[:-1]
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while spec and spec[-1] is None:  # jit returns specs in this form: P(x, None) would miss
        spec.pop()                    # its compile cache and compile the step a second time
    return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, names: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, shape, dict(mesh.shape)))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint by logical names under the ambient mesh (`jax.set_mesh`); else a no-op."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, dict(mesh.shape)))


def pieces(name: str, mesh_shape: dict[str, int], size: int | None = None) -> int:
    """Into how many pieces a mesh of `mesh_shape` splits a dimension with logical axis `name`
    (of `size`, where given: its mesh axes that do not divide it are left out)."""
    spec = logical_to_spec([name], None if size is None else [size], mesh_shape)
    axes = spec[0] if spec else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return int(np.prod([mesh_shape[a] for a in axes]))


def shards(name: str, size: int) -> int:
    """Into how many pieces the ambient mesh (`jax.set_mesh`) splits a dimension of `size` with
    logical axis `name` (1 without a mesh, or where its mesh axes do not divide `size`)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else pieces(name, dict(mesh.shape), size)


def put(x, sharding: NamedSharding) -> jax.Array:
    """`jax.device_put` that also works when `sharding` spans several processes: a value that
    is the same on every process (a process-local array) gives each process its own shards
    (no cross-process transfer or equality check)."""
    if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(put(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
    value = np.asarray(x)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def replicated(sharding):
    """A sharding that holds the whole array on every device `sharding` spans."""
    return NamedSharding(sharding.mesh, PartitionSpec()) if isinstance(sharding, NamedSharding) else sharding


def replicate(tree, mesh: Mesh):
    """Every array of `tree` whole on every device of `mesh` (small state: LoRA's adapters)."""
    return jax.tree.map(lambda x: put(x, NamedSharding(mesh, jax.sharding.PartitionSpec())), tree)


def shard_params(state, mesh: Mesh):
    """Place every parameter (an nnx Variable with `axes` metadata) into its sharding."""
    from flax import nnx

    def place(v):
        axes = v.get_metadata().get("axes")
        if axes is None:
            raise ValueError(f"parameter of shape {v.shape} has no logical `axes` metadata")
        return v.replace(put(v[...], named_sharding(mesh, axes, v.shape)))
    return jax.tree.map(place, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """Rows over the data-parallel axes, everything else replicated."""
    names = ("batch",) + ("length",) * (len(shape) - 1)
    return named_sharding(mesh, names, shape)


def match_param_shardings(tree, params, mesh: Mesh):
    """Shardings for a tree whose leaves mirror parameters (optimizer moments): a leaf whose
    path ends with a parameter's path gets that parameter's sharding, any other is replicated.
    (Zeros created under jit carry no data dependence, so propagation alone may replicate them.)"""
    by_path = {tuple(str(k) for k in path): leaf.sharding
               for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    longest = max((len(p) for p in by_path), default=0)

    def pick(path, _):
        keys = tuple(str(k) for k in path)
        for n in range(min(longest, len(keys)), 0, -1):
            if keys[-n:] in by_path:
                return by_path[keys[-n:]]
        return NamedSharding(mesh, PartitionSpec())
    return jax.tree_util.tree_map_with_path(pick, tree)
