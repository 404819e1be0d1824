"""A decode step's MLP on the sampler's spread mesh: its collectives, and one Pallas TPU kernel.

There the MLP's weights are split over every device (`mlp` over tensor and the row groups), and
a decode step's rows over the groups. Each device norms its group's rows, the groups all-gather
them, each device multiplies all the rows by its slice of the weights, and a reduce-scatter (then
a sum over tensor) hands each group its rows' sums back.

XLA runs the gated MLP as three dots that each go through HBM: the gathered rows are read by the
gate's and by the up projection's, the gate's output is written and read back, the activation
written and read by the down projection. At a 7B decode step these are 320 rows of 3584, 10 MB
of the layer's 189 beside 25 MB of MLP weights. `fused_mlp` keeps them in VMEM: it reads the rows
and each weight once and writes the output once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sem_jax.kernels.tpu_layout import lanes_swapped
from sem_jax.sharding import logical_to_spec

ROW_AXES = ("batch", "length", "act_embed")
VMEM_BUDGET = 12 * 2**20  # of the 16 MiB of VMEM of a v4 core (newer chips have more)
BLOCKS = (512, 256, 128)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _plan(n: int, e: int, m: int, item: int) -> tuple[int, int, int] | None:
    """(block of the gate's and up's input rows, block of the down's output columns, VMEM bytes)
    of the largest blocks whose buffers fit `VMEM_BUDGET` for n rows, embedding e and (this
    device's) intermediate m, or None where none fit."""
    for eb in (b for b in BLOCKS if e % b == 0):
        for ob in (b for b in BLOCKS if e % b == 0):
            # Double-buffered blocks (rows, gate, up, down, out), the accumulators, the rows' scales.
            need = 2 * item * (n * eb + 2 * eb * m + m * ob + n * ob) + n * m * (8 + item) + 2 * n * 128 * 4
            if need <= VMEM_BUDGET:
                return eb, ob, need
    return None


def fits(n: int, e: int, m: int, item: int) -> bool:
    """Whether `fused_mlp` takes n rows of embedding e over an intermediate slice of m."""
    return _plan(n, e, m, item) is not None


def normed(x: jax.Array, scale: jax.Array, weight: jax.Array) -> jax.Array:
    """RMS-normed rows of x [N, E] given each row's float32 `scale` [N, 1] (1 / its RMS) and the
    norm's weight [1, E], rounded as `qwen2.rms_norm` rounds: x * scale to x's dtype, then times
    the weight."""
    n = (x.astype(jnp.float32) * scale).astype(x.dtype)
    return weight.astype(x.dtype) * n


def _dot(a: jax.Array, b: jax.Array, b_transposed: bool) -> jax.Array:
    """a @ b, or a @ b.T where b is given transposed, accumulated in float32."""
    return jax.lax.dot_general(a, b, (((1,), (1 if b_transposed else 0,)), ((), ())),
                               preferred_element_type=jnp.float32)


def _kernel(layer_ref, x_ref, r_ref, w_ref, g_ref, u_ref, d_ref, o_ref, acc_g, acc_u, act, *,
            steps: int, tg: bool, td: bool):
    del layer_ref  # used by the index maps only
    i = pl.program_id(0)

    @pl.when(i == 0)
    def _():
        acc_g[...] = jnp.zeros(acc_g.shape, jnp.float32)
        acc_u[...] = jnp.zeros(acc_u.shape, jnp.float32)

    @pl.when(i < steps)
    def _():
        h = normed(x_ref[...], r_ref[...], w_ref[...])
        acc_g[...] += _dot(h, g_ref[...], tg)
        acc_u[...] += _dot(h, u_ref[...], tg)

    @pl.when(i == steps - 1)
    def _():
        # Rounded as XLA's three dots round them: gate and up to the compute dtype, then silu * up.
        g = acc_g[...].astype(act.dtype).astype(jnp.float32)
        u = acc_u[...].astype(act.dtype).astype(jnp.float32)
        act[...] = (g * jax.nn.sigmoid(g) * u).astype(act.dtype)

    @pl.when(i >= steps)
    def _():
        o_ref[...] = _dot(act[...], d_ref[...], td).astype(o_ref.dtype)


def fused_mlp(x: jax.Array, scale: jax.Array, norm_weight: jax.Array, gate: jax.Array, up: jax.Array,
              down: jax.Array, layer: jax.Array | None = None, *, interpret: bool = False) -> jax.Array:
    """The MLP block's output silu(h @ gate) * (h @ up) @ down for the RMS-normed rows h of x
    [N, E] (`normed(x, scale [N, 1], norm_weight [1, E])`), gate and up [E, M], down [M, E], in
    x's dtype, as one kernel; or, given `layer`, of layer `layer` of stacked weights [L, E, M] and
    [L, M, E], read where they lie (a custom call's operand sliced out of the stack would be a
    copy of the layer's weights at every step).

    Its grid walks the embedding in blocks for the gate and up projections (into float32
    accumulators of [N, M]), then the output's columns for the down projection: every operand is
    read once, the normed rows and the [N, M] intermediates never leave VMEM."""
    if layer is None:
        gate, up, down, layer = gate[None], up[None], down[None], jnp.zeros((), jnp.int32)
    n, e = x.shape
    m = gate.shape[-1]
    plan = _plan(n, e, m, x.dtype.itemsize)
    if plan is None:
        raise ValueError(f"fused_mlp: {n} rows x {m} intermediate columns do not fit VMEM ({VMEM_BUDGET} bytes)")
    eb, ob, need = plan
    steps, outs = e // eb, e // ob
    first = lambda i: jnp.minimum(i, steps - 1)  # an index map that repeats a block fetches nothing
    second = lambda i: jnp.maximum(i - steps, 0)
    # Each weight in its stored order (`lanes_swapped`), its blocks indexed to match.
    tg, td = lanes_swapped((e, m)), lanes_swapped((m, e))
    gu_spec = (pl.BlockSpec((None, m, eb), lambda i, l: (l[0], 0, first(i))) if tg else
               pl.BlockSpec((None, eb, m), lambda i, l: (l[0], first(i), 0)))
    d_spec = (pl.BlockSpec((None, ob, m), lambda i, l: (l[0], second(i), 0)) if td else
              pl.BlockSpec((None, m, ob), lambda i, l: (l[0], 0, second(i))))
    if tg:
        gate, up = jnp.swapaxes(gate, 1, 2), jnp.swapaxes(up, 1, 2)
    if td:
        down = jnp.swapaxes(down, 1, 2)
    item = x.dtype.itemsize
    cost = pl.CostEstimate(flops=6 * n * e * m, transcendentals=n * m,
                           bytes_accessed=item * (2 * n * e + 3 * e * m + e) + 4 * n)
    return pl.pallas_call(
        functools.partial(_kernel, steps=steps, tg=tg, td=td),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(steps + outs,),
            in_specs=[pl.BlockSpec((n, eb), lambda i, l: (0, first(i))), pl.BlockSpec((n, 1), lambda i, l: (0, 0)),
                      pl.BlockSpec((1, eb), lambda i, l: (0, first(i))), gu_spec, gu_spec, d_spec],
            out_specs=pl.BlockSpec((n, ob), lambda i, l: (0, second(i))),
            scratch_shapes=[pltpu.VMEM((n, m), jnp.float32), pltpu.VMEM((n, m), jnp.float32),
                            pltpu.VMEM((n, m), x.dtype)]),
        out_shape=jax.ShapeDtypeStruct((n, e), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=need + 2 * 2**20),
        cost_estimate=cost, interpret=interpret, name="fused_mlp",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), x, scale.astype(jnp.float32), norm_weight, gate, up, down)


def spread_mlp(x: jax.Array, norm_weight: jax.Array, weights: dict[str, jax.Array],
               axes: dict[str, tuple[str, ...]], scale, mlp, layer: jax.Array) -> jax.Array:
    """x + mlp(rms_norm(x)) for a decode step's rows x [B, 1, E] (`ROW_AXES`) on the spread mesh:
    `scale(x)` (each row's float32 1 / RMS, [..., 1]) on each group's rows, gathered with them,
    and `mlp(x, scale, norm_weight, weights, layer)` (the XLA dots or `fused_mlp`: the norm
    applied to the gathered rows) on all the rows [N, E] and the device's slices of `weights`
    (logical `axes` by name; the embedding whole, the intermediate split over the row groups and
    more), which gives partial sums over those slices. `layer`: an index into stacked weights."""
    mesh = jax.sharding.get_abstract_mesh()
    shape = dict(mesh.shape)
    x_spec = logical_to_spec(ROW_AXES, x.shape, shape)
    specs = {k: logical_to_spec(axes[k], w.shape, shape) for k, w in weights.items()}
    rows = _axes(x_spec[0] if x_spec else None)
    split = {a for k, spec in specs.items() for name, entry in zip(axes[k], spec) if name == "mlp" for a in _axes(entry)}
    whole = all(not _axes(entry) for k, spec in specs.items() for name, entry in zip(axes[k], spec) if name == "embed")
    if not set(rows) <= split or not whole:
        raise ValueError(f"spread_mlp wants the rows split over some of the MLP's weight axes {sorted(split)}, "
                         f"have {rows}, and the embedding whole ({specs})")
    rest = tuple(sorted(split - set(rows)))

    def local(x, norm_w, weights, layer):
        r, t, e = x.shape  # the collectives on [rows, E]: the TPU compiler fuses a 2-D reduce-scatter
        flat = x.reshape(r * t, e)
        gather = lambda a: jax.lax.all_gather(a, rows, axis=0, tiled=True)
        out = mlp(gather(flat), gather(scale(flat)), norm_w.reshape(1, e), weights, layer)
        out = jax.lax.psum_scatter(out, rows, scatter_dimension=0, tiled=True)
        return x + (jax.lax.psum(out, rest) if rest else out).reshape(r, t, e)

    P = jax.sharding.PartitionSpec
    return jax.shard_map(local, mesh=mesh, in_specs=(x_spec, P(), specs, P()),
                         out_specs=x_spec, check_vma=False)(x, norm_weight, weights, layer)
