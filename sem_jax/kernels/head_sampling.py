"""A decode step's LM head and sampling in one Pallas TPU kernel, on the spread mesh.

There each device computes its slice of the vocabulary for every row (`Qwen2.logits` in the
spread layout) and draws its candidate token (`sampler.sample_spread`). Through XLA the logits
([320, 9504] float32 per device at a 7B step, 12 MB) are written by the head's matmul and read
back by the reduction: a fifth of the step's bytes beyond the head's weights. This kernel walks
the device's vocabulary in blocks and keeps each block's logits in VMEM: per row it carries the
softmax's running max and sum and the best Gumbel-perturbed candidate, and returns those.

The Gumbel noise comes from a counter-based hash of (key, row, token id), not `jax.random`: each
token's noise is its own, whatever mesh splits the vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sem_jax.kernels.tpu_layout import lanes_swapped

VMEM_BUDGET = 12 * 2**20
BLOCK = 512  # most vocabulary entries per block


def _hash(x: jax.Array) -> jax.Array:
    """A 32-bit integer mix (lowbias32: each output bit depends on every input bit)."""
    x = x ^ jax.lax.shift_right_logical(x, jnp.uint32(16))
    x = x * jnp.uint32(0x21F0AAAD)
    x = x ^ jax.lax.shift_right_logical(x, jnp.uint32(15))
    x = x * jnp.uint32(0x735A2D97)
    return x ^ jax.lax.shift_right_logical(x, jnp.uint32(15))


def gumbel_noise(seed, counter: jax.Array) -> jax.Array:
    """Standard Gumbel noise, float32, for uint32 counters (token ids) under two uint32 seeds (a
    row's): a hash of both to 23 uniform bits, strictly inside (0, 1), then -log(-log u)."""
    bits = _hash(_hash(counter ^ seed[0]) + seed[1])
    u = (jax.lax.shift_right_logical(bits, jnp.uint32(9)).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))
    return -jnp.log(-jnp.log(u))


def _plan(n: int, e: int, v: int, transposed: bool, item: int) -> int | None:
    """The largest block of the vocabulary (dividing v: whole sublanes for a weight stored
    [V, E], whole lanes for [E, V]) whose buffers fit `VMEM_BUDGET` beside the rows, else None."""
    step = 8 if transposed else 128
    for vb in range(min(BLOCK, v) // step * step, 0, -step):
        if v % vb == 0 and 2 * item * (n * e + vb * e) + 6 * 4 * n * vb + 14 * 4 * n * 128 <= VMEM_BUDGET:
            return vb
    return None


def fits(n: int, e: int, v: int, item: int) -> bool:
    """Whether `head_candidates` takes n rows of embedding e over a vocabulary slice of v."""
    return _plan(n, e, v, lanes_swapped((e, v)), item) is not None


def _kernel(scalars_ref, seed0_ref, seed1_ref, h_ref, w_ref, m_ref, s_ref, best_ref, id_ref, pick_ref, *,
            scale: float, greedy: bool, transposed: bool, block: int):
    j = pl.program_id(0)
    offset = scalars_ref[0]

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        s_ref[...] = jnp.zeros(s_ref.shape, jnp.float32)
        best_ref[...] = jnp.full(best_ref.shape, -jnp.inf, jnp.float32)
        id_ref[...] = jnp.zeros(id_ref.shape, jnp.int32)
        pick_ref[...] = jnp.zeros(pick_ref.shape, jnp.float32)

    dims = (((1,), (1 if transposed else 0,)), ((), ()))
    x = jax.lax.dot_general(h_ref[...], w_ref[...], dims, preferred_element_type=jnp.float32) * scale
    col = j * block + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)  # in the device's slice
    score = x
    if not greedy:
        counter = (offset + col).astype(jnp.uint32)  # the token id; the row is in its seeds
        seed = [seed0_ref[...].astype(jnp.uint32), seed1_ref[...].astype(jnp.uint32)]  # [N, 1] each
        score = x + gumbel_noise(seed, counter)
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, jnp.max(x, axis=1, keepdims=True))
    s_ref[...] = s_ref[...] * jnp.exp(m_prev - m_new) + jnp.sum(jnp.exp(x - m_new), axis=1, keepdims=True)
    m_ref[...] = m_new
    # The block's first maximum (a NaN counts as one), then the running best: a later block wins
    # only when strictly better, so ties keep the lowest id.
    top = jnp.max(score, axis=1, keepdims=True)
    first = jnp.min(jnp.where((score == top) | (score != score), col, jnp.iinfo(jnp.int32).max), axis=1, keepdims=True)
    at = col == first
    pick = jnp.max(jnp.where(at, x, -jnp.inf), axis=1, keepdims=True)
    prev = best_ref[...]
    better = (top > prev) | ((top != top) & (prev == prev))
    best_ref[...] = jnp.where(better, top, prev)
    id_ref[...] = jnp.where(better, first + offset, id_ref[...])
    pick_ref[...] = jnp.where(better, pick, pick_ref[...])


def head_candidates(h: jax.Array, w: jax.Array, seeds: jax.Array, offset: jax.Array, *, scale: float,
                    greedy: bool, interpret: bool = False) -> tuple[jax.Array, ...]:
    """For rows h [N, E] and a device's slice w [E, V] of the LM head (token ids offset..offset+V;
    `offset` an int32 scalar), its candidate per row without writing the logits x = (h @ w) *
    scale: (max x, sum exp(x - max), the best x + Gumbel noise (x when `greedy`), its token id,
    its x), each [N]. `seeds`: uint32 [N, 2], each row's noise key (a function of the row alone,
    so that a row draws the same wherever it lies)."""
    n, e = h.shape
    v = w.shape[1]
    transposed = lanes_swapped((e, v))
    vb = _plan(n, e, v, transposed, h.dtype.itemsize)
    if vb is None:
        raise ValueError(f"head_candidates: {n} rows x a vocabulary slice of {v} do not fit VMEM ({VMEM_BUDGET} bytes)")
    w_spec = (pl.BlockSpec((vb, e), lambda j, s: (j, 0)) if transposed else pl.BlockSpec((e, vb), lambda j, s: (0, j)))
    row = pl.BlockSpec((n, 1), lambda j, s: (0, 0))
    f32, i32 = jax.ShapeDtypeStruct((n, 1), jnp.float32), jax.ShapeDtypeStruct((n, 1), jnp.int32)
    cost = pl.CostEstimate(flops=2 * n * e * v, transcendentals=n * v * (1 if greedy else 3),
                           bytes_accessed=h.dtype.itemsize * (n * e + e * v) + 5 * 4 * n)
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, greedy=greedy, transposed=transposed, block=vb),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(v // vb,),
            in_specs=[row, row, pl.BlockSpec((n, e), lambda j, s: (0, 0)), w_spec],
            out_specs=[row] * 5),
        out_shape=[f32, f32, f32, i32, f32],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=VMEM_BUDGET + 2**22),
        cost_estimate=cost, interpret=interpret, name="head_candidates",
    )(jnp.reshape(offset, (1,)).astype(jnp.int32), *(jax.lax.bitcast_convert_type(seeds[:, i:i + 1].astype(jnp.uint32),
                                                                               jnp.int32) for i in (0, 1)),
      h, w.T if transposed else w)
    return tuple(o[:, 0] for o in out)
