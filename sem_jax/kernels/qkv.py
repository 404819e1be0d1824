"""A decode step's attention inputs in one Pallas TPU kernel: the layer's input norm, the query,
key and value projections with their biases (Qwen2) or their per-head norms (Qwen3), and the
rotary embedding.

Through XLA each projection reads the step's rows again (normed on the fly), the query's bias,
its rotation's halves and the rotation each go through HBM: at a 7B decode step about 2.5 MB of
a layer's activation traffic beside 7 MB of attention weights. This kernel reads the rows and
each weight once, where the stacked weights lie, and writes the rotated q and k and the v.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sem_jax.kernels.spread_mlp import BLOCKS, normed
from sem_jax.kernels.tpu_layout import sublanes_moved

VMEM_BUDGET = 12 * 2**20


def _plan(n: int, e: int, heads: int, d: int, item: int) -> tuple[int, int] | None:
    """(block of the embedding, VMEM bytes of the buffers: the kernel's values take about as much
    again) for n rows and `heads` projected heads of d, or None."""
    for eb in (b for b in BLOCKS if e % b == 0):
        need = 2 * item * (n * eb + heads * eb * d + heads * n * d) + heads * n * d * 4 + 4 * n * d * 4
        if 2 * need <= VMEM_BUDGET:
            return eb, need
    return None


def fits(n: int, e: int, heads: int, d: int, item: int) -> bool:
    """Whether `fused_qkv` takes n rows of embedding e into `heads` query, key and value heads of d."""
    return d % 128 == 0 and _plan(n, e, heads, d, item) is not None


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """`qwen2.apply_rope` of one head's rows x [N, D] float32 (rotate_half as a roll of half the
    lanes, its first half negated: the same numbers)."""
    d = x.shape[-1]
    sign = jnp.where(jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) < d // 2, -1.0, 1.0)
    return x * cos + pltpu.roll(x, d // 2, 1) * sign * sin


def _kernel(layer_ref, x_ref, r_ref, nw_ref, qw_ref, kw_ref, vw_ref, qb_ref, kb_ref, vb_ref, cos_ref, sin_ref,
            *refs, steps: int, moved: tuple[bool, bool], eps: float | None):
    del layer_ref  # used by the index maps only
    qn_ref, kn_ref = refs[:2] if eps is not None else (None, None)
    q_out, k_out, v_out, acc_q, acc_k, acc_v = refs[-6:]
    i = pl.program_id(0)

    @pl.when(i == 0)
    def _():
        for acc in (acc_q, acc_k, acc_v):
            acc[...] = jnp.zeros(acc.shape, jnp.float32)

    h = normed(x_ref[...], r_ref[...], nw_ref[...])
    for w_ref, acc, major in ((qw_ref, acc_q, moved[0]), (kw_ref, acc_k, moved[1]), (vw_ref, acc_v, moved[1])):
        for j in range(acc.shape[0]):
            w = w_ref[j] if major else w_ref[:, j, :]  # [eb, D]
            acc[j] += jnp.dot(h, w, preferred_element_type=jnp.float32)

    @pl.when(i == steps - 1)
    def _():
        # Rounded as XLA's path rounds: the projection, plus its bias, its head's norm, then the
        # rotation.
        dt = q_out.dtype
        cos, sin = cos_ref[...], sin_ref[...]
        for acc, b_ref, n_ref, out, rotate in ((acc_q, qb_ref, qn_ref, q_out, True), (acc_k, kb_ref, kn_ref, k_out, True),
                                               (acc_v, vb_ref, None, v_out, False)):
            for j in range(acc.shape[0]):
                y = (acc[j].astype(dt).astype(jnp.float32) + b_ref[j:j + 1, :].astype(jnp.float32)).astype(dt)
                if n_ref is not None:
                    yf = y.astype(jnp.float32)
                    scale = jax.lax.rsqrt(jnp.mean(yf * yf, axis=-1, keepdims=True) + eps)
                    y = normed(y, scale, n_ref[...])
                y = y.astype(jnp.float32)
                out[:, j, :] = (rope(y, cos, sin) if rotate else y).astype(dt)


def fused_qkv(x: jax.Array, scale: jax.Array, norm_weight: jax.Array, wq: jax.Array, wk: jax.Array,
              wv: jax.Array, bq: jax.Array, bk: jax.Array, bv: jax.Array, cos: jax.Array, sin: jax.Array,
              layer: jax.Array, *, qk_norm: tuple[jax.Array, jax.Array, float] | None = None,
              interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v [N, H, D] (q and k rotated) for rows x [N, E] normed as `spread_mlp.normed(x,
    scale [N, 1], norm_weight [1, E])`, layer `layer` of the stacked kernels wq [L, E, Hq, D], wk
    and wv [L, E, Hk, D] (read where they lie), that layer's biases bq [Hq, D], bk and bv [Hk, D]
    (zeros for a model without), and each row's rotary tables cos, sin [N, D] float32, in x's
    dtype. `qk_norm` = (q's norm weight [1, D], k's, eps): each head of q and k RMS-normed before
    its rotation (Qwen3)."""
    n, e = x.shape
    hq, hk, d = wq.shape[2], wk.shape[2], wq.shape[3]
    plan = _plan(n, e, hq + 2 * hk, d, x.dtype.itemsize)
    if plan is None:
        raise ValueError(f"fused_qkv: {n} rows x {hq + 2 * hk} heads do not fit VMEM ({VMEM_BUDGET} bytes)")
    eb, need = plan
    steps = e // eb
    moved = (sublanes_moved(wq.shape), sublanes_moved(wk.shape))

    def w_spec(h, major):  # a weight in its stored order: [L, H, E, D] where its heads are moved out
        if major:
            return pl.BlockSpec((None, h, eb, d), lambda i, l: (l[0], 0, i, 0))
        return pl.BlockSpec((None, eb, h, d), lambda i, l: (l[0], i, 0, 0))

    whole = lambda *shape: pl.BlockSpec(shape, lambda i, l: (0,) * len(shape))
    wq, wk, wv = (jnp.swapaxes(w, 1, 2) if m else w for w, m in ((wq, moved[0]), (wk, moved[1]), (wv, moved[1])))
    item = x.dtype.itemsize
    cost = pl.CostEstimate(flops=2 * n * e * (hq + 2 * hk) * d, transcendentals=0,
                           bytes_accessed=item * (n * e + e + (e + 1 + n) * (hq + 2 * hk) * d) + 4 * n * (1 + 2 * d))
    out = lambda h: jax.ShapeDtypeStruct((n, h, d), x.dtype)
    norms = [] if qk_norm is None else [w.reshape(1, d) for w in qk_norm[:2]]
    return pl.pallas_call(
        functools.partial(_kernel, steps=steps, moved=moved, eps=None if qk_norm is None else float(qk_norm[2])),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(steps,),
            in_specs=[pl.BlockSpec((n, eb), lambda i, l: (0, i)), whole(n, 1),
                      pl.BlockSpec((1, eb), lambda i, l: (0, i)),
                      w_spec(hq, moved[0]), w_spec(hk, moved[1]), w_spec(hk, moved[1]),
                      whole(hq, d), whole(hk, d), whole(hk, d), whole(n, d), whole(n, d),
                      *(whole(1, d) for _ in norms)],
            out_specs=[whole(n, hq, d), whole(n, hk, d), whole(n, hk, d)],
            scratch_shapes=[pltpu.VMEM((hq, n, d), jnp.float32), pltpu.VMEM((hk, n, d), jnp.float32),
                            pltpu.VMEM((hk, n, d), jnp.float32)]),
        out_shape=[out(hq), out(hk), out(hk)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=2 * need + 2**21),
        cost_estimate=cost, interpret=interpret, name="fused_qkv",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), x, scale.astype(jnp.float32), norm_weight, wq, wk, wv,
      bq, bk, bv, cos, sin, *norms)
