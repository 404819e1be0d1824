"""Attention over a stacked KV cache as one Pallas TPU kernel (flash attention over the cache).

The XLA path (`qwen2.attention`) writes each layer's float32 scores and probabilities to HBM
and reads them back for the softmax and the value dot: at an insert (hundreds of query tokens
over a window of thousands of slots) most of the pass's bytes, at a decode step a few percent of
a layer's. This kernel keeps them in VMEM: it streams the cache window block by block, carries
the softmax's running max and sum (online softmax), and returns the unnormalised output with
both, so that the caller merges in this call's own keys (`attend_cache`, `merge`).

It reads the stacked cache [layers, batch, slots, kv_heads, head_dim] where it lies, the layer
chosen by a prefetched scalar (no layer's window is sliced out into a copy), and skips the
blocks past the longest row of each group of rows. It wants one KV head per device: the TPU
compiler stores a size-1 head axis outside the slots, so the kernel's [.., heads, slots, dim]
view is the same bytes; with several heads per device they are interleaved and that view would
be a copy of the cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sem_jax.sharding import logical_to_spec, shards

NEG = -1e30  # masked score: exp(NEG - m) == 0 for any real m, and NEG - NEG stays finite
LANES = 128  # the running max and sum are kept lane-broadcast, as TPU vectors want them


def _blocks(b: int, nq: int, query_block: int) -> tuple[int, int, int]:
    """(rows per block, query rows per block, query rows padded to whole blocks): a decode's few
    query rows (its heads) batched over 8 rows of the cache, an insert's thousands tiled into
    blocks that fit VMEM beside their accumulators."""
    # One block of all the query rows where they fit (a block as long as its dim needs no
    # padding: a decode's 7 heads are not copied into 8), else whole sublanes.
    qb = nq if nq <= query_block else query_block
    rows = next(n for n in (8, 4, 2, 1) if b % n == 0 and n * qb <= query_block)
    return rows, qb, -(-nq // qb) * qb


def _kernel(layer_ref, lengths_ref, blocks_ref, q_ref, k_ref, v_ref, *refs, rows: int, block: int, scale: float,
            own: bool):
    del layer_ref, blocks_ref  # used by the index maps only
    if own:
        ko_ref, vo_ref, o_ref, m_sc, l_sc, acc = refs
    else:
        o_ref, m_ref, l_ref, m_sc, l_sc, acc = refs
    g, s = pl.program_id(0), pl.program_id(3)

    @pl.when(s == 0)
    def _():
        if own:  # the softmax starts from the row's own key: max its score, sum 1, output its value
            for r in range(rows):
                # [Q, D] . [1, D] as a product and a lane sum (a dot with one column fails to lower)
                first = jnp.sum(q_ref[r].astype(jnp.float32) * ko_ref[r].astype(jnp.float32), axis=1,
                                keepdims=True) * scale  # [Q, 1]
                m_sc[r] = jnp.broadcast_to(first, m_sc.shape[1:])
                acc[r] = jnp.broadcast_to(vo_ref[r].astype(jnp.float32), acc.shape[1:])
            l_sc[...] = jnp.ones(l_sc.shape, jnp.float32)
        else:
            m_sc[...] = jnp.full(m_sc.shape, NEG, jnp.float32)
            l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
            acc[...] = jnp.zeros(acc.shape, jnp.float32)

    start = s * block
    for r in range(rows):
        length = lengths_ref[g * rows + r]

        @pl.when(start < length)
        def _():
            q = q_ref[r]  # [Q, D]
            sc = jax.lax.dot_general(q, k_ref[r], (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32) * scale  # [Q, block]
            slot = start + jax.lax.broadcasted_iota(jnp.int32, sc.shape, 1)
            sc = jnp.where(slot < length, sc, NEG)
            m_prev = m_sc[r]  # [Q, LANES]
            m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_new)
            p = jnp.exp(sc - m_new[:, :1])
            l_sc[r] = alpha * l_sc[r] + jnp.sum(p, axis=1, keepdims=True)
            # Slots past the cache's end in a partial last block hold garbage: zero them, since
            # a zero probability times a NaN is still NaN.
            valid = start + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0) < length
            v = jnp.where(valid, v_ref[r], jnp.zeros((), v_ref.dtype))
            pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)  # [Q, D]
            acc[r] = acc[r] * alpha[:, :1] + pv
            m_sc[r] = m_new

    @pl.when(s == pl.num_programs(3) - 1)
    def _():
        if own:
            o_ref[...] = (acc[...] / l_sc[:, :, :1]).astype(o_ref.dtype)
        else:
            o_ref[...] = acc[...]
            m_ref[...] = m_sc[...]
            l_ref[...] = l_sc[...]


def cache_attention_local(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                          lengths: jax.Array, window: int, own: tuple[jax.Array, jax.Array] | None = None, *,
                          block: int = 512, query_block: int = 512, interpret: bool = False):
    """One device's attention of q [B, K, Q, D] over slots < lengths[b] (at most `window`) of
    layer `layer` of k_cache/v_cache [L, B, S, K, D], K == 1. Returns the unnormalised output
    [B, K, Q, D] float32 and the running max and sum [B, K, Q] float32, for the caller to merge
    its own keys in (`merge`).

    `own`: each row's one own key and value [B, K, 1, D] (a decode step's, seen by all its query
    rows), which the softmax starts from: returns the attention output [B, K, Q, D] in q's dtype,
    normalised, and nothing else (no float32 output, running max and sum written and read back)."""
    b, kv, nq, d = q.shape
    rows, qb, qp = _blocks(b, nq, query_block)
    # As few blocks of at most `block` slots as cover the window, evened out (2784 = 6 x 464) so
    # that the last one reads little past it; whole 16-row bfloat16 tiles.
    n_blocks = -(-window // block)
    block = -(-window // n_blocks // 16) * 16 if window > 16 else 16
    q = jnp.pad(q, ((0, 0), (0, 0), (0, qp - nq), (0, 0)))
    lengths = jnp.minimum(lengths.astype(jnp.int32), window)
    # Blocks each group of rows needs: an index map that repeats a block index fetches nothing.
    need = jnp.max(lengths.reshape(b // rows, rows), axis=1)
    last = jnp.maximum((need + block - 1) // block - 1, 0).astype(jnp.int32)

    def cache_map(g, j, i, s, layer_ref, lengths_ref, last_ref):
        return layer_ref[0], g, j, jnp.minimum(s, last_ref[g]), 0

    def row_map(g, j, i, s, *_):
        return g, j, i, 0

    cache_spec = pl.BlockSpec((None, rows, None, block, d), cache_map)
    row_spec = lambda width: pl.BlockSpec((rows, None, qb, width), row_map)
    item = k_cache.dtype.itemsize
    q_blocks = qp // qb  # the cache window is read once per block of query rows
    window_bytes = 2 * b * q_blocks * n_blocks * block * d * item + q.size * q.dtype.itemsize
    flops, exps = 4 * b * qp * n_blocks * block * d, b * qp * n_blocks * block
    if own is None:
        extra_in, out_specs = [], [row_spec(d), row_spec(LANES), row_spec(LANES)]
        out_shape = [jax.ShapeDtypeStruct((b, kv, qp, d), jnp.float32),
                     jax.ShapeDtypeStruct((b, kv, qp, LANES), jnp.float32),
                     jax.ShapeDtypeStruct((b, kv, qp, LANES), jnp.float32)]
        nbytes = window_bytes + b * qp * (d + 2 * LANES) * 4
    else:
        own_spec = pl.BlockSpec((rows, None, 1, d), lambda g, j, i, s, *_: (g, j, 0, 0))
        extra_in, out_specs = [own_spec, own_spec], [row_spec(d)]
        out_shape = [jax.ShapeDtypeStruct((b, kv, qp, d), q.dtype)]
        nbytes = window_bytes + sum(a.size * a.dtype.itemsize for a in own) + b * kv * qp * d * q.dtype.itemsize
    out = pl.pallas_call(
        functools.partial(_kernel, rows=rows, block=block, scale=d ** -0.5, own=own is not None),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(b // rows, kv, q_blocks, n_blocks),
            in_specs=[row_spec(d), cache_spec, cache_spec, *extra_in],
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((rows, qb, LANES), jnp.float32),
                            pltpu.VMEM((rows, qb, LANES), jnp.float32),
                            pltpu.VMEM((rows, qb, d), jnp.float32)]),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=exps, bytes_accessed=nbytes),
        interpret=interpret, name="cache_attention",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), lengths, last, q,
      jnp.swapaxes(k_cache, 2, 3), jnp.swapaxes(v_cache, 2, 3), *(own or ()))
    if own is not None:
        return out[0][:, :, :nq]
    o, m, l = out
    return o[:, :, :nq], m[:, :, :nq, 0], l[:, :, :nq, 0]


def cache_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                    lengths: jax.Array, window: int, cache_axes: tuple[str, ...],
                    own: tuple[jax.Array, jax.Array] | None = None, *, interpret: bool = False):
    """`cache_attention_local` on every device of the ambient mesh (`jax.set_mesh`), each on its
    own rows and KV head: q [B, K, Q, D] (and `own`'s keys and values [B, K, 1, D]) by (batch,
    act_kv_heads), the caches by their logical `cache_axes`, lengths by batch."""
    mesh = jax.sharding.get_abstract_mesh()
    local = lambda q, k_cache, v_cache, layer, lengths, own: cache_attention_local(
        q, k_cache, v_cache, layer, lengths, window, own, interpret=interpret)
    if mesh.empty:
        return local(q, k_cache, v_cache, layer, lengths, own)
    shape = dict(mesh.shape)
    q_spec = logical_to_spec(("batch", "act_kv_heads", None, None), q.shape, shape)
    c_spec = logical_to_spec(cache_axes, k_cache.shape, shape)
    r_spec = logical_to_spec(("batch", "act_kv_heads", None), q.shape[:3], shape)
    b_spec = logical_to_spec(("batch",), lengths.shape, shape)
    out_specs = q_spec if own is not None else (q_spec, r_spec, r_spec)
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(q_spec, c_spec, c_spec, jax.sharding.PartitionSpec(), b_spec, q_spec),
                         out_specs=out_specs, check_vma=False)(q, k_cache, v_cache, layer, lengths, own)


def local_kv_heads(num_kv_heads: int) -> int:
    return num_kv_heads // shards("act_kv_heads", num_kv_heads)


def attend_cache(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, k_cache: jax.Array,
                 v_cache: jax.Array, layer: jax.Array, lengths: jax.Array, window: int,
                 cache_axes: tuple[str, ...], *, interpret: bool = False) -> jax.Array:
    """`qwen2.attention` of q [B, T, H, D] over slots < lengths of layer `layer` of a stacked
    cache and over this call's own keys k, v [B, T, K, D] (mask [B, T, T], True = attend), the
    cache part in the kernel (a decode step's one own key too: T = 1, always seen). Returns
    [B, T, H, D] in q's dtype."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    # Query rows (head in group, token): a decode's are its G heads, an insert's G * T.
    qk = jnp.moveaxis(q.reshape(b, t, kv, h // kv, d), 1, 3).reshape(b, kv, h // kv * t, d)
    if t == 1:  # a decode step: its own key (always seen) goes into the kernel's softmax
        own = tuple(jnp.moveaxis(a, 1, 2).astype(q.dtype) for a in (k, v))  # [B, K, 1, D]
        out = cache_attention(qk, k_cache, v_cache, layer, lengths, window, cache_axes, own, interpret=interpret)
        return out.reshape(b, 1, h, d)
    o, m, l = cache_attention(qk, k_cache, v_cache, layer, lengths, window, cache_axes, interpret=interpret)
    own = jnp.einsum("bkqd,btkd->bkqt", qk, k, preferred_element_type=jnp.float32) * d ** -0.5
    own = own.reshape(b, kv, h // kv, t, t)
    own = jnp.where(mask[:, None, None], own, NEG).reshape(b, kv, h // kv * t, t)
    out = merge(o, m, l, own, v).reshape(b, kv, h // kv, t, d)
    return jnp.moveaxis(out, 3, 1).reshape(b, t, h, d).astype(q.dtype)


def merge(o: jax.Array, m: jax.Array, l: jax.Array, scores: jax.Array, v: jax.Array) -> jax.Array:
    """Attention over the cache (`cache_attention`'s o [B, K, Q, D], m, l [B, K, Q]) and over this
    call's own keys (scores [B, K, Q, T] float32, scaled and masked; v [B, T, K, D]) in one
    softmax. Returns [B, K, Q, D] float32."""
    m_all = jnp.maximum(m, jnp.max(scores, axis=-1))
    a = jnp.exp(m - m_all)
    p = jnp.exp(scores - m_all[..., None])
    pv = jnp.einsum("bkqt,btkd->bkqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return (o * a[..., None] + pv) / (l * a + jnp.sum(p, axis=-1))[..., None]
