"""Causal self-attention without a cache as Pallas TPU kernels: jax's splash attention (flash
attention's forward and backward, blocks above the diagonal skipped).

The XLA path (`qwen2.attention`) writes every layer's float32 scores and probabilities to HBM:
for the update's 3072-token rows most of the step's bytes (its forward, the remat's second
forward and the backward each write and read them), which makes the update memory-bound. The
kernels keep them in VMEM, a block at a time. Used for the training forward (the update and
the reference pass) and for a prefill, on TPU, where the sequence is whole 128-token blocks.

XLA's cost analysis cannot see into a Pallas kernel and splash gives it no estimate (it counts
no FLOPs for it), so `hlo_cost` adds the kernels' own: the blocks their grids compute and fetch.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from sem_jax.sharding import logical_to_spec, shards

BLOCKS = (512, 256, 128)  # the largest that divides the sequence: fewer grid steps, same VMEM fit


def block(t: int) -> int | None:
    """The kernels' block (query and key rows) for a sequence of `t` tokens, None if none fits."""
    return next((b for b in BLOCKS if t % b == 0), None)


def applies(t: int, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernels take this call under the ambient mesh: whole blocks of tokens and
    128-lane heads, and each device's query heads all in groups of its own KV heads (the
    tensor axis splits both alike; a replicated KV head would pair the wrong groups)."""
    return (block(t) is not None and head_dim % 128 == 0
            and shards("act_heads", num_heads) == shards("act_kv_heads", num_kv_heads))


def _kernel(t: int, heads: int, interpret: bool) -> splash.SplashAttentionKernel:
    # Built at each trace, not cached: its mask tables become arrays of the trace.
    b = block(t)
    mask = splash.MultiHeadMask([splash.CausalMask((t, t))] * heads)
    sizes = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                              block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def flash_attention_local(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, *,
                          interpret: bool = False) -> jax.Array:
    """Causal grouped-query attention of q [B, T, H, D] over k, v [B, T, K, D] on one device; with
    `segment_ids` [B, T] a token sees only keys of its own id. Returns [B, T, H, D]."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    # splash does not scale the scores: the scale goes into q, rounded once to its dtype.
    q = (q.astype(jnp.float32) * d ** -0.5).astype(q.dtype)
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # [B, heads, T, D]
    if segment_ids is None:
        # The rows as more heads of one kernel call: query head b * H + j is in the group of KV
        # head b * K + j // (H / K), as it should. (A vmap over the rows runs them in a loop.)
        kernel = _kernel(t, b * h, interpret)
        out = kernel(q.reshape(b * h, t, d), k.reshape(b * kv, t, d), v.reshape(b * kv, t, d)).reshape(b, h, t, d)
    else:  # the ids are per row, the kernel's are one for all its heads: a call per row
        kernel = _kernel(t, h, interpret)
        ids = segment_ids.astype(jnp.int32)
        out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s)))(q, k, v, ids)
    return jnp.swapaxes(out, 1, 2)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *,
                    interpret: bool = False) -> jax.Array:
    """`flash_attention_local` on every device of the ambient mesh (`jax.set_mesh`), each on its
    own rows and heads: q by (batch, length, act_heads, head_dim), k and v by act_kv_heads."""
    mesh = jax.sharding.get_abstract_mesh()
    local = functools.partial(flash_attention_local, interpret=interpret)
    if mesh.empty:
        return local(q, k, v, segment_ids)
    shape = dict(mesh.shape)
    q_spec = logical_to_spec(("batch", "length", "act_heads", "head_dim"), q.shape, shape)
    kv_spec = logical_to_spec(("batch", "length", "act_kv_heads", "head_dim"), k.shape, shape)
    if segment_ids is None:
        return jax.shard_map(lambda q, k, v: local(q, k, v, None), mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec),
                             out_specs=q_spec, check_vma=False)(q, k, v)
    s_spec = logical_to_spec(("batch", "length"), segment_ids.shape, shape)
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, s_spec), out_specs=q_spec,
                         check_vma=False)(q, k, v, segment_ids)


# -- the kernels' cost, for the roofline ------------------------------------------------------

# A splash kernel in a compiled TPU program: `%splash_mha_<kind>... = <shapes> custom-call(`.
_KERNEL_LINE = re.compile(r"%splash_mha_(fwd|dq|dkv)\S* = (.*?) custom-call\(")
_SHAPE = re.compile(r"(bf16|f16|f32)\[([\d,]+)\]")
_ITEM = {"bf16": 2, "f16": 2, "f32": 4}


def kernel_cost(kind: str, heads: int, t: int, d: int, item: int) -> tuple[float, float]:
    """(FLOPs, HBM bytes) of one splash kernel over `heads` (rows x query heads) causal sequences
    of `t` tokens: per block on or below the diagonal, the forward's 2 matmuls and its key and
    value blocks; the backward's dq kernel 3 matmuls and dkv kernel 4 (each recomputes the
    scores), each fetching the other side's blocks. Each side's own blocks move once."""
    b = block(t)
    n = t // b
    computed = n * (n + 1) // 2
    dot = 2 * b * b * d  # one [b, d] x [d, b] matmul
    side = t * d * item  # one head's q (or o, do, dq, k, v, ...) whole
    vec = t * 4          # one head's logsumexp (or the dq kernel's di), float32
    if kind == "fwd":  # reads q, writes o and the logsumexp; per block a key and a value block
        return heads * computed * 2 * dot, heads * (2 * side + vec + computed * 2 * b * d * item)
    if kind == "dq":  # reads q, do, logsumexp, di, writes dq; per block k and v
        return heads * computed * 3 * dot, heads * (3 * side + 2 * vec + computed * 2 * b * d * item)
    # dkv: reads k, v, writes dk, dv; per block q, do, logsumexp and di
    return heads * computed * 4 * dot, heads * (4 * side + computed * (2 * b * d * item + 2 * b * 4))


def hlo_cost(hlo: str) -> dict[str, float]:
    """The splash kernels' FLOPs and bytes in a compiled program's text (as XLA's cost analysis
    counts a loop's body: once; rows with segment ids run as such a loop, one kernel call per
    row, the roofline's calls have none). The rows and heads of each from its output's shape: the
    forward's and dq's [.., heads, T, D] in q's dtype; dkv's outputs are per KV head, and its
    work per query head is that of the dq kernel it runs beside."""
    total = {"flops": 0.0, "bytes": 0.0}
    found: dict[str, list[tuple[int, int, int, int]]] = {"fwd": [], "dq": [], "dkv": []}
    for kind, outputs in _KERNEL_LINE.findall(hlo):
        dtype, dims = next((m[0], [int(x) for x in m[1].split(",")]) for m in _SHAPE.findall(outputs)
                           if m[1].count(",") >= 2)
        heads = 1
        for x in dims[:-2]:
            heads *= x
        found[kind].append((heads, dims[-2], dims[-1], _ITEM[dtype]))
    if len(found["dq"]) != len(found["dkv"]):
        raise ValueError(f"{len(found['dq'])} splash dq kernels beside {len(found['dkv'])} dkv kernels")
    for kind, key in (("fwd", "fwd"), ("dq", "dq"), ("dkv", "dq")):  # dkv: the query heads of its dq
        for heads, t, d, item in found[key]:
            flops, nbytes = kernel_cost(kind, heads, t, d, item)
            total["flops"] += flops
            total["bytes"] += nbytes
    return total
