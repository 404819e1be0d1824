"""The Qwen2 / Qwen3 decoder in Flax NNX, numerically the same model as HF `Qwen2ForCausalLM`
and `Qwen3ForCausalLM` (the config's `model_type` switches q/k/v biases for per-head q/k norms).

Layers are stored stacked (leading `layers` axis) and run under `lax.scan`, so
compile time does not grow with depth. Every parameter carries its logical axis
names as `axes` metadata; `sem_jax.sharding` maps them to the mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sem_jax.kernels import cache_attention, dispatch, flash_attention, head_sampling, qkv, spread_mlp
from sem_jax.model.architecture import Qwen2Config
from sem_jax.sharding import constrain, logical_to_spec, shards

# Layer parameter name -> (logical axes, initialiser kind).
LAYER_PARAMS: dict[str, tuple[tuple[str, ...], str]] = {
    "input_norm": (("layers", "embed"), "ones"),
    "q_kernel": (("layers", "embed", "heads", "head_dim"), "normal"),
    "q_bias": (("layers", "heads", "head_dim"), "zeros"),
    "k_kernel": (("layers", "embed", "kv_heads", "head_dim"), "normal"),
    "k_bias": (("layers", "kv_heads", "head_dim"), "zeros"),
    "v_kernel": (("layers", "embed", "kv_heads", "head_dim"), "normal"),
    "v_bias": (("layers", "kv_heads", "head_dim"), "zeros"),
    "q_norm": (("layers", "head_dim"), "ones"),
    "k_norm": (("layers", "head_dim"), "ones"),
    "o_kernel": (("layers", "heads", "head_dim", "embed"), "normal"),
    "post_norm": (("layers", "embed"), "ones"),
    "gate_kernel": (("layers", "embed", "mlp"), "normal"),
    "up_kernel": (("layers", "embed", "mlp"), "normal"),
    "down_kernel": (("layers", "mlp", "embed"), "normal"),
}

KERNELS = ("q_kernel", "k_kernel", "v_kernel", "o_kernel", "gate_kernel", "up_kernel", "down_kernel")


def kernel_matrix(name: str, w: jax.Array, hidden: int) -> jax.Array:
    """One layer's kernel as its 2-D [in, out] matrix."""
    return w.reshape(-1, hidden) if name == "o_kernel" else w.reshape(w.shape[0], -1)

# Named rematerialisation presets for the scanned layer body.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}

# Stacked keys and values, slots before heads: [S, K, D] as this call's new keys are [T, K, D].
CACHE_AXES = ("layers", "batch", "cache_length", "act_kv_heads", "head_dim")
# The residual stream a per-layer cache keeps (KVCache.resid), and one the caller gives.
RESID_AXES = ("batch", "cache_length", "act_embed")
# One layer's values and (transposed) keys in a per-layer cache, see KVCache.
LAYER_CACHE_AXES = ("batch", "act_kv_heads", "cache_length", "head_dim")
LAYER_KEY_AXES = ("batch", "act_kv_heads", "head_dim", "cache_length")
# The logits of an LM head in the spread layout (`Qwen2.logits`): every row, a share of the vocabulary.
HEAD_LOGITS_AXES = ("spread_rows", "act_head_vocab")


def cache_axes(per_layer: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Logical axes of each key and value array of a stacked or per-layer `KVCache`."""
    return (LAYER_KEY_AXES, LAYER_CACHE_AXES) if per_layer else (CACHE_AXES, CACHE_AXES)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys/values of every layer, slot `s` of row `b` holds absolute position `s`.

    `lengths[b]` is how many positions of row `b` are filled; each row advances
    on its own, so prompts of different lengths share one batch.

    Stacked (one [layers, batch, max_length, kv_heads, head_dim] array each for keys and
    values, read under the layer scan) or per layer (for `hidden_states(layers=...)`: tuples
    of [batch, kv_heads, head_dim, max_length] keys, transposed for the decode's dot, and
    [batch, kv_heads, max_length, head_dim] values).

    `resid` (per-layer caches, `init_cache(resid_layer=i)`): the residual stream entering layer
    `resid_layer` at each filled position [batch, max_length, E], kept beside the keys: a LoRA
    update whose lowest adapted layer is i starts there instead of running the frozen layers again.
    """

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]
    lengths: jax.Array  # [batch] int32
    resid: jax.Array | None = None
    resid_layer: int = dataclasses.field(default=-1, metadata=dict(static=True))

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, tuple)

    @property
    def max_length(self) -> int:
        return self.v[0].shape[-2] if self.per_layer else self.v.shape[2]

    def repeat_rows(self, n: int) -> "KVCache":
        """Each row copied to `n` consecutive rows (row r -> rows r * n ... r * n + n - 1)."""
        rep = lambda x, axis: jnp.repeat(x, n, axis=axis)
        axis = 0 if self.per_layer else 1  # stacked caches lead with the layer axis
        kv = lambda c: jax.tree.map(lambda x: rep(x, axis), c)
        return dataclasses.replace(self, k=kv(self.k), v=kv(self.v), lengths=rep(self.lengths, 0),
                                   resid=None if self.resid is None else rep(self.resid, 0))


QKV_BIASES = ("q_bias", "k_bias", "v_bias")
QK_NORMS = ("q_norm", "k_norm")


def _layer_shapes(cfg: Qwen2Config) -> dict[str, tuple[int, ...]]:
    """Each layer parameter's stacked shape, those of the config's architecture only."""
    l, e, h, k, d, m = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                        cfg.head_dim, cfg.intermediate_size)
    shapes = {
        "input_norm": (l, e), "q_kernel": (l, e, h, d), "q_bias": (l, h, d),
        "k_kernel": (l, e, k, d), "k_bias": (l, k, d), "v_kernel": (l, e, k, d),
        "v_bias": (l, k, d), "q_norm": (l, d), "k_norm": (l, d), "o_kernel": (l, h, d, e), "post_norm": (l, e),
        "gate_kernel": (l, e, m), "up_kernel": (l, e, m), "down_kernel": (l, m, e),
    }
    absent = (() if cfg.attention_bias else QKV_BIASES) + (() if cfg.qk_norm else QK_NORMS)
    return {name: shape for name, shape in shapes.items() if name not in absent}


def param_shapes(cfg: Qwen2Config) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Flat name -> (shape, logical axes) for every parameter, in the state's naming."""
    out = {"embed": ((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"))}
    for name, shape in _layer_shapes(cfg).items():
        out[f"layers.{name}"] = (shape, LAYER_PARAMS[name][0])
    out["final_norm"] = ((cfg.hidden_size,), ("embed",))
    if not cfg.tie_word_embeddings:
        out["lm_head"] = ((cfg.hidden_size, cfg.vocab_size), ("embed", "head_vocab"))
    return out


def _gathers_rows(n: int) -> bool:
    """Whether `n` rows are split over row groups that the spread weights (the MLP's, the LM
    head's: `spread_rows` in sharding.RULES) are split over too, so that the rows must be gathered
    to every group to meet them (only on the sampler's spread mesh)."""
    return shards("spread_rows", n) != shards("batch", n)


def _dense(x: jax.Array, p: dict[str, jax.Array], name: str) -> jax.Array:
    """A projection of x [N, *in] (the kernel's input dims) as one matmul over the N = batch *
    length rows (XLA's dot, and its transpose in the backward pass, is far faster than with two
    batch-like dims): [N, *out], or [N, prod(out)] from an [out, in] kernel. The kernel's dims
    are contracted as stored: reshaped to 2-D first, a [E, H, D] kernel with H per device not a
    multiple of 8 (TPU tiles pad it) is copied (the decode loop held a copy of every layer's)."""
    if name + "_t" in p:  # [out, in] (layer_list(transposed=True))
        return jax.lax.dot_general(x.reshape(x.shape[0], -1), p[name + "_t"], (((1,), (1,)), ((), ())))
    return jax.lax.dot_general(x, p[name], ((tuple(range(1, x.ndim)), tuple(range(x.ndim - 1))), ((), ())))


MLP_KERNELS = ("gate_kernel", "up_kernel", "down_kernel")


def _mlp(h: jax.Array, p: dict[str, jax.Array], rows: tuple[int, int] | None = None) -> jax.Array:
    """Qwen2's gated MLP on rows h [N, E] with a layer's weights p; `rows` = (B, T), N = B * T:
    its activations laid out by their logical axes (not inside a `shard_map`)."""
    act = jax.nn.silu(_dense(h, p, "gate_kernel")) * _dense(h, p, "up_kernel")
    if rows is not None:
        act = constrain(act.reshape(*rows, -1), ("batch", "length", "act_mlp")).reshape(h.shape[0], -1)
    return _dense(act, p, "down_kernel")


def rms_scale(x: jax.Array, eps: float) -> jax.Array:
    """Each row's float32 1 / RMS [..., 1] for `rms_norm`."""
    xf = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # As HF: normalise in f32, cast back, then scale.
    return spread_mlp.normed(x, rms_scale(x, eps), weight)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin [B, T, head_dim] for integer positions [B, T] (HF's non-interleaved layout)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, heads, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    xf = x.astype(jnp.float32)
    out = xf * cos[:, :, None, :] + rotated.astype(jnp.float32) * sin[:, :, None, :]
    return out.astype(x.dtype)


def attention(q: jax.Array, k: jax.Array | None, v: jax.Array | None, mask: jax.Array | None,
              cache: tuple[jax.Array, jax.Array, jax.Array] | None = None) -> jax.Array:
    """Grouped-query attention of q [B,T,H,D] over this call's keys k/v [B,T,K,D]
    (mask [B,T,T], True = attend) and, when given, a read-only cache
    (k_cache [B,S,K,D], v_cache [B,S,K,D], cache_mask [B,S] or [B,T,S]).

    k = v = mask = None: a per-layer cache that already holds this call's keys, keys stored
    transposed (k_cache [B,K,D,S], v_cache [B,K,S,D], cache_mask [B,T,S]).
    The cache is only read here, so attention never copies it.
    """
    b, t, h, d = q.shape
    kv = k.shape[2] if k is not None else cache[1].shape[1]
    q = q.reshape(b, t, kv, h // kv, d)
    neg = jnp.finfo(jnp.float32).min
    scale = d ** -0.5
    if k is None:
        # Two dots with batch axes (B, K) in the caches' stored layouts, which XLA:CPU hands
        # to its fast dot library: keys stored [D, S] make a one-token decode's scores 4.6x
        # faster than a multiply-and-reduce over [S, D] keys. Queries as [B, K, G*T, D] (a
        # free reshape when T = 1).
        k_t, v_cache, cache_mask = cache
        g = h // kv
        qm = jnp.moveaxis(q, 1, 3).reshape(b, kv, g * t, d)
        scores = jnp.einsum("bkqd,bkds->bkqs", qm, k_t, preferred_element_type=jnp.float32) * scale
        scores = jnp.where(cache_mask[:, None, None, :, :], scores.reshape(b, kv, g, t, -1), neg)
        probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype).reshape(b, kv, g * t, -1)
        out = jnp.einsum("bkqs,bksd->bkqd", probs, v_cache).reshape(b, kv, g, t, d)
        return jnp.moveaxis(out, 3, 1).reshape(b, t, h, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, neg)
    if cache is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, d)
    k_cache, v_cache, cache_mask = cache
    s = k_cache.shape[1]
    # Dots also for a one-token decode: they read the cache in its stored dtype, where a float32
    # multiply-and-reduce made the TPU program write a float32 copy of each layer's window.
    old = jnp.einsum("btkgd,bskd->bkgts", q, k_cache, preferred_element_type=jnp.float32)
    cm = cache_mask[:, None, None, None, :] if cache_mask.ndim == 2 else cache_mask[:, None, None, :, :]
    old = jnp.where(cm, old * scale, neg)
    probs = jax.nn.softmax(jnp.concatenate([old, scores], axis=-1), axis=-1)
    p_old = probs[..., :s]
    out_old = jnp.einsum("bkgts,bskd->btkgd", p_old.astype(v_cache.dtype), v_cache)
    out = out_old + jnp.einsum("bkgts,bskd->btkgd", probs[..., s:].astype(v.dtype), v)
    return out.reshape(b, t, h, d)


class Qwen2(nnx.Module):
    """Qwen2 causal LM. `model(tokens [B, T]) -> logits [B, T, V]` (float32)."""

    def __init__(self, config: Qwen2Config, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32,
                 dtype: Any = jnp.float32, remat: str = "none", scan_unroll: int = 1,
                 cache_kernel: str = "auto", attention_kernel: str = "auto", decode_kernel: str = "auto"):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat={remat!r}; choose one of {sorted(REMAT_POLICIES)}")
        for name, mode in (("cache_kernel", cache_kernel), ("attention_kernel", attention_kernel),
                           ("decode_kernel", decode_kernel)):
            dispatch.check_mode(name, mode)
        self.config = config
        # How a stacked cache's window is attended to (`cache_kernel`) and a sequence to itself
        # without a cache (`attention_kernel`: the training forward, a prefill): "pallas" (the
        # kernels of `cache_attention` and `flash_attention`), "interpret" (the same kernels
        # interpreted, on any backend: tests), "xla" (`attention`), "auto" (the kernel where it
        # compiles for TPUs and applies, else XLA). `decode_kernel`: the same for a decode step's
        # fused kernels on stacked weights (`kernels.qkv`: its attention inputs; on the sampler's
        # spread mesh `spread_mlp.fused_mlp`, and `head_sampling`, the LM head with sampling, where
        # `head_kernel_mode` says).
        self.cache_kernel = cache_kernel
        self.attention_kernel = attention_kernel
        self.decode_kernel = decode_kernel
        # Layers per iteration of the layer scans. XLA's cost analysis counts a loop's body once,
        # so `sem_jax.aot.roofline` compiles 1 and 2 and takes one layer's cost as the difference.
        self.scan_unroll = scan_unroll
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.remat = remat
        normal = jax.nn.initializers.normal(0.02)

        def param(shape, axes, kind):
            if kind == "normal":
                value = normal(rngs.params(), shape, param_dtype)
            else:
                value = (jnp.ones if kind == "ones" else jnp.zeros)(shape, param_dtype)
            return nnx.Param(value, axes=axes)

        shapes = param_shapes(config)
        self.embed = param(*shapes["embed"], "normal")
        self.layers = nnx.Dict({name: param(*shapes[f"layers.{name}"], kind)
                                for name, (_, kind) in LAYER_PARAMS.items() if f"layers.{name}" in shapes})
        self.final_norm = param(*shapes["final_norm"], "ones")
        if not config.tie_word_embeddings:
            self.lm_head = param(*shapes["lm_head"], "normal")

    # -- forward -------------------------------------------------------------------------

    def __call__(self, tokens: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        """Full forward pass without a cache; `attention_mask` [B, T] marks real tokens."""
        hidden, _ = self.hidden_states(tokens, attention_mask=attention_mask)
        return self.logits(hidden)

    def logits(self, hidden: jax.Array, keep_head_layout: bool = False) -> jax.Array:
        """LM head on final (normed) hidden states [..., E] -> float32 logits [..., V].

        `keep_head_layout`: where the head computes them in the spread layout (`spreads_head`),
        leave them there, every row on every device and the vocabulary split over all of them
        (`HEAD_LOGITS_AXES`), for a caller that reduces them there (the decode step's sampling)."""
        w = self.lm_head_weight()
        flat = hidden.reshape(-1, hidden.shape[-1])
        v = w.shape[-1]
        # An untied head on the sampler's spread mesh is split over the row groups too
        # (`head_vocab`): there the rows, when they weigh less than a device's share of the head
        # (one token per row: a decode step, the last token of a prefill or an insert), are
        # gathered to every group; each device computes its slice of the vocabulary for all of
        # them, and (unless `keep_head_layout`) an all-to-all hands each group its own rows'
        # logits, split over the vocabulary as everywhere else (`act_vocab`).
        gather = self.spreads_head(flat.shape[0])
        if gather:
            flat = constrain(flat, ("spread_rows", "act_embed"))
        out = jnp.dot(flat, w, preferred_element_type=jnp.float32)
        if gather:
            out = constrain(out, HEAD_LOGITS_AXES)
            if not keep_head_layout:
                out = constrain(out, ("batch", "act_vocab"))
        return out.reshape(*hidden.shape[:-1], v)

    def spreads_head(self, n: int) -> bool:
        """Whether the LM head computes `n` rows' logits in the spread layout (`logits`): an
        untied head split over the row groups, rows that weigh less than a device's share of it."""
        v = self.config.vocab_size
        return not self.config.tie_word_embeddings and n * shards("vocab", v) < v and _gathers_rows(n)

    def head_kernel_mode(self, n: int) -> str | None:
        """The `decode_kernel` mode in which the sampler draws a decode step's tokens for `n` rows
        in the spread layout (`spreads_head`) by `head_sampling` (no logits written), or None for
        `logits` and a reduction over them."""
        c = self.config
        v = c.vocab_size // shards("head_vocab", c.vocab_size)
        applies = head_sampling.fits(n, c.hidden_size, v, jnp.dtype(self.dtype).itemsize)
        return dispatch.choice("decode_kernel", self.decode_kernel, applies, applies and dispatch.on_tpu(),
                              f"{n} rows by a vocabulary slice of {v} in {head_sampling.VMEM_BUDGET} bytes of VMEM")

    def lm_head_weight(self) -> jax.Array:
        """[E, V] output projection in the compute dtype (for chunked log-prob code)."""
        w = self.embed[...].T if self.config.tie_word_embeddings else self.lm_head[...]
        return w.astype(self.dtype)

    def extend(self, tokens: jax.Array, cache: KVCache, num_new: jax.Array | None = None,
               window: int | None = None, layers: list[dict[str, jax.Array]] | None = None
               ) -> tuple[jax.Array, KVCache]:
        """Append `tokens` [B, T] to each row of `cache` at that row's own length.

        Row b's real tokens are `tokens[b, :num_new[b]]` (right padded); its cache
        length advances by `num_new[b]` (all T when None). Returns float32 logits
        [B, T, V] and the updated cache. Prefill (empty cache), one-token decode and
        mid-sequence insertion of retrieved text are all this one call. `window` and `layers`:
        see `hidden_states`.
        """
        hidden, cache = self.hidden_states(tokens, cache=cache, num_new=num_new, window=window, layers=layers)
        return self.logits(hidden), cache

    def init_cache(self, batch: int, max_length: int, dtype: Any = None, per_layer: bool = False,
                   resid_layer: int = -1) -> KVCache:
        """An empty cache; `resid_layer` >= 0 (per-layer only) keeps the residual entering that layer too."""
        c = self.config
        shape = (batch, c.num_kv_heads, max_length, c.head_dim)
        dtype = dtype or self.dtype
        k_axes, v_axes = cache_axes(per_layer)
        if per_layer:
            zeros = lambda shape, axes: tuple(constrain(jnp.zeros(shape, dtype), axes) for _ in range(c.num_layers))
            k = zeros((batch, c.num_kv_heads, c.head_dim, max_length), k_axes)
            v = zeros(shape, v_axes)
        else:
            stacked = (c.num_layers, batch, max_length, c.num_kv_heads, c.head_dim)
            k, v = (constrain(jnp.zeros(stacked, dtype), axes) for axes in (k_axes, v_axes))
        resid = None
        if resid_layer >= 0:
            if not per_layer:
                raise ValueError("the residual stream is kept with a per-layer cache only (init_cache(per_layer=True))")
            resid = constrain(jnp.zeros((batch, max_length, c.hidden_size), dtype), RESID_AXES)
        return KVCache(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32), resid=resid, resid_layer=resid_layer)

    def layer_list(self, transposed: bool = False) -> list[dict[str, jax.Array]]:
        """Each layer's weights as arrays of their own, for `hidden_states(layers=...)`.

        `transposed`: every kernel as a 2-D [out, in] array named `<name>_t` (the sampler's
        copy: XLA:CPU's 8-row decode matmuls read the 0.5B shape's weights 10% faster so).
        """
        layers = [{name: p[...][i] for name, p in self.layers.items()} for i in range(self.config.num_layers)]
        if transposed:
            for p in layers:
                for name in KERNELS:
                    p[name + "_t"] = kernel_matrix(name, p.pop(name), self.config.hidden_size).T
        return layers

    def hidden_states(self, tokens: jax.Array, *, attention_mask: jax.Array | None = None,
                      segment_ids: jax.Array | None = None, cache: KVCache | None = None,
                      num_new: jax.Array | None = None, window: int | None = None,
                      layers: list[dict[str, jax.Array]] | None = None,
                      residual: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
        """Final-normed hidden states [B, T, E], and the updated cache when one is given.

        Without a cache (`forward`): `attention_mask` [B, T] marks real tokens, or
        `segment_ids` [B, T] packs several sequences in a row (a token sees only its own run of
        equal ids; positions restart at each run).

        With a cache (`extend_stacked`, or `extend_per_layer` with `layers`): `window` (static)
        has attention read only the first `window` cache slots (0: none, as in a prefill; None:
        all). The caller guarantees every row that matters has at most `window` filled slots;
        the writes still go to the whole cache.

        `layers` (from `layer_list`): run the layers one by one on these weights instead of
        scanning the stacked ones (with a per-layer cache, or none). Under the scan XLA:CPU
        copies each layer's weights and cache window before using them, at every decode step;
        arrays of their own are read in place.

        `residual` [B, T, E]: the residual stream entering `layers[0]` (per-layer weights: a run of
        the top layers, the ones below done before, `KVCache.resid`) instead of the tokens'
        embeddings; the tokens still give the positions and masks.
        """
        if residual is not None and layers is None:
            raise ValueError("a given residual stream enters per-layer weights (layers=...), the layers above it")
        if cache is None:
            return self.forward(tokens, attention_mask=attention_mask, segment_ids=segment_ids, layers=layers,
                                residual=residual), None
        if cache.per_layer != (layers is not None):
            raise ValueError("a per-layer KV cache goes with per-layer weights (layers=model.layer_list())"
                             if cache.per_layer else
                             "per-layer weights need a per-layer KV cache (init_cache(per_layer=True))")
        if layers is None:
            if cache.resid is not None:
                raise ValueError("the residual stream is kept with a per-layer cache only")
            return self.extend_stacked(tokens, cache, num_new=num_new, window=window)
        return self.extend_per_layer(tokens, cache, layers, num_new=num_new, window=window, residual=residual)

    def forward(self, tokens: jax.Array, *, attention_mask: jax.Array | None = None,
                segment_ids: jax.Array | None = None, layers: list[dict[str, jax.Array]] | None = None,
                residual: jax.Array | None = None) -> jax.Array:
        """The training forward pass (no cache): final-normed hidden states [B, T, E]."""
        b, t = tokens.shape
        idx = jnp.arange(t, dtype=jnp.int32)
        causal = idx[None, :, None] >= idx[None, None, :]
        if segment_ids is not None:
            start = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
            positions = idx[None, :] - jax.lax.cummax(jnp.where(start, idx[None, :], 0), axis=1)
            mask = causal & (segment_ids[:, :, None] == segment_ids[:, None, :])
        elif attention_mask is None:
            positions = jnp.broadcast_to(idx, (b, t))
            mask = jnp.broadcast_to(causal, (b, t, t))
        else:
            key_ok = attention_mask.astype(bool)
            positions = jnp.maximum(jnp.cumsum(key_ok, axis=-1, dtype=jnp.int32) - 1, 0)
            mask = causal & key_ok[:, None, :]
        x, cos, sin = self._embed(tokens, positions, residual)
        attend = self._self_attention(t, mask, segment_ids if segment_ids is not None else attention_mask)

        def layer(x, p):
            return self._block(x, p, cos, sin, lambda q, k, v: (attend(q, k, v), None))

        layer = self._remat(layer)
        if layers is not None:
            for p in layers:
                x, _ = layer(x, p)
        else:
            x, _ = jax.lax.scan(layer, x, self._stacked(), unroll=self.scan_unroll)
        return rms_norm(x, self.final_norm[...], self.config.rms_norm_eps)

    def extend_stacked(self, tokens: jax.Array, cache: KVCache, *, num_new: jax.Array | None = None,
                       window: int | None = None) -> tuple[jax.Array, KVCache]:
        """Prefill, insert or decode into a stacked cache under the layer scan (TPU, GPU): each
        layer reads the cache before this call, then each layer's new keys are written."""
        b, t = tokens.shape
        idx = jnp.arange(t, dtype=jnp.int32)
        causal = idx[None, :, None] >= idx[None, None, :]
        positions = cache.lengths[:, None] + idx[None, :]  # slot s holds position s
        mask = jnp.broadcast_to(causal, (b, t, t))
        window = min(cache.max_length if window is None else window, cache.max_length)
        cache_mask = jnp.arange(window, dtype=jnp.int32)[None, :] < cache.lengths[:, None]  # past a row's length: stale
        x, cos, sin = self._embed(tokens, positions)
        kernel = self._cache_kernel(cache) if window else None
        own = None if window else self._self_attention(t, mask, None)  # a prefill: no cache read

        def layer(x, xs):
            p, i, kc, vc = xs
            if own is not None:
                attend = lambda q, k, v: (own(q, k, v), (k, v))
            elif kernel:  # the kernel reads layer i of the whole cache in place
                attend = lambda q, k, v: (cache_attention.attend_cache(
                    q, k, v, mask, cache.k, cache.v, i, cache.lengths, window, CACHE_AXES,
                    interpret=kernel == "interpret"), (k, v))
            else:
                read = (kc.astype(self.dtype), vc.astype(self.dtype), cache_mask)
                attend = lambda q, k, v: (attention(q, k, v, mask, read), (k, v))
            return self._block(x, p, cos, sin, attend, layer=i)

        rows = jnp.arange(b)[:, None]
        # Only the window is read: decode cost grows with the text, not with the cache
        # preallocated for the whole response budget.
        kv_in = (cache.k[:, :, :window], cache.v[:, :, :window]) if window and not kernel else (None, None)
        index = jnp.arange(self.config.num_layers, dtype=jnp.int32)  # for kernels that read the stacks in place
        x, (k_new, v_new) = jax.lax.scan(self._remat(layer), x, (self._stacked(), index, *kv_in),
                                         unroll=self.scan_unroll)
        # Written layer by layer after the scan, each layer's slab of the cache in place. (One
        # scatter for all layers wants the layers beside head_dim in memory, the scan wants them
        # outermost: the TPU compiler then copied the whole cache between the two at every step.)
        # Layer i's new keys [B, T, K, D] go to slots `positions` of its [B, S, K, D] slab.
        def write(i, kv):
            kc, vc = kv
            return (kc.at[i, rows, positions].set(k_new[i].astype(kc.dtype), mode="drop"),
                    vc.at[i, rows, positions].set(v_new[i].astype(vc.dtype), mode="drop"))
        k_all, v_all = jax.lax.fori_loop(0, k_new.shape[0], write, (cache.k, cache.v), unroll=self.scan_unroll)
        return self._finish(x, cache, k_all, v_all, t, num_new)

    def extend_per_layer(self, tokens: jax.Array, cache: KVCache, layers: list[dict[str, jax.Array]], *,
                         num_new: jax.Array | None = None, window: int | None = None,
                         residual: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Prefill, insert or decode into a per-layer cache, layer by layer (the CPU layout: keys
        stored [B, K, D, S]). Each layer writes this call's keys first and then reads its window
        (`window + T` slots): a read before the write made XLA:CPU copy the whole cache."""
        b, t = tokens.shape
        idx = jnp.arange(t, dtype=jnp.int32)
        positions = cache.lengths[:, None] + idx[None, :]
        window = min((cache.max_length if window is None else window) + t, cache.max_length)
        # Token j sees the slots up to its own position (this call's keys are already written).
        cache_mask = jnp.arange(window, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]
        x, cos, sin = self._embed(tokens, positions, residual)
        rows = jnp.arange(b)[:, None]

        def layer(x, xs):
            p, kc, vc = xs

            def attend(q, k, v):
                kc_new = kc.at[rows, :, :, positions].set(k.astype(kc.dtype), mode="drop")
                vc_new = vc.at[rows, :, positions].set(v.astype(vc.dtype), mode="drop")
                read = (kc_new[..., :window].astype(self.dtype), vc_new[:, :, :window].astype(self.dtype), cache_mask)
                return attention(q, None, None, None, read), (kc_new, vc_new)
            return self._block(x, p, cos, sin, attend)

        layer = self._remat(layer)
        k_all, v_all = [], []
        for i, p in enumerate(layers):
            if i == cache.resid_layer and cache.resid is not None:  # kept at the positions the keys go to
                cache = dataclasses.replace(cache, resid=constrain(cache.resid.at[rows, positions].set(
                    x.astype(cache.resid.dtype), mode="drop"), RESID_AXES))
            x, (k, v) = layer(x, (p, cache.k[i], cache.v[i]))
            k_all.append(k)
            v_all.append(v)
        return self._finish(x, cache, tuple(k_all), tuple(v_all), t, num_new)

    # -- pieces of every forward path ---------------------------------------------------------

    def _embed(self, tokens: jax.Array, positions: jax.Array,
               residual: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The first layer's input (the tokens' embeddings, or a given `residual`) and RoPE's tables."""
        x = self.embed[...].astype(self.dtype)[tokens] if residual is None else residual.astype(self.dtype)
        x = constrain(x, ("batch", "length", "act_embed"))
        return (x, *rope_tables(positions, self.config.head_dim, self.config.rope_theta))

    def _cache_kernel(self, cache: KVCache) -> str | None:
        """The kernel mode for a decode's or an insert's attention to a stacked cache, None for XLA's
        `attention`. The kernel wants the cache in the compute dtype and one KV head per device (a
        device with several stores them interleaved, and the kernel's view of one of them would be
        a copy); "auto" also wants whole 128-lane heads."""
        c = self.config
        applies = (cache.k.dtype == jnp.dtype(self.dtype)
                   and cache_attention.local_kv_heads(c.num_kv_heads) == 1)
        auto = applies and c.head_dim % 128 == 0 and dispatch.on_tpu()
        return dispatch.choice("cache_kernel", self.cache_kernel, applies, auto,
                              f"a {jnp.dtype(self.dtype).name} cache (have {cache.k.dtype}) and one KV head per "
                              f"device (have {cache_attention.local_kv_heads(c.num_kv_heads)} of {c.num_kv_heads})")

    def _self_attention(self, t: int, mask: jax.Array, segment_ids: jax.Array | None):
        """`attend(q, k, v)` for `t` tokens attending causally to themselves, without a cache:
        `flash_attention`'s kernels where `attention_kernel` picks them (they take the mask as
        causal within `segment_ids`: a padded row's 0/1 attention mask, or packed rows' ids;
        they differ from `mask` only at padding, whose outputs nothing reads), else XLA's
        `attention` with `mask` [B, T, T]."""
        c = self.config
        applies = flash_attention.applies(t, c.num_heads, c.num_kv_heads, c.head_dim)
        mode = dispatch.choice("attention_kernel", self.attention_kernel, applies, applies and dispatch.on_tpu(),
                              f"whole blocks of {flash_attention.BLOCKS[-1]} tokens (have {t}), head_dim % 128 == 0 "
                              f"(have {c.head_dim}) and the query and KV heads split alike over the mesh "
                              f"({c.num_heads} and {c.num_kv_heads} heads)")
        if mode is None:
            return lambda q, k, v: attention(q, k, v, mask)
        return lambda q, k, v: flash_attention.flash_attention(q, k, v, segment_ids, interpret=mode == "interpret")

    def _stacked(self) -> dict[str, jax.Array]:
        return {name: p[...] for name, p in self.layers.items()}

    def _remat(self, layer):
        if self.remat == "none":
            return layer
        return jax.checkpoint(layer, policy=REMAT_POLICIES[self.remat], prevent_cse=False)

    def _block(self, x: jax.Array, p: dict[str, jax.Array], cos: jax.Array, sin: jax.Array, attend,
               layer: jax.Array | None = None):
        """One decoder layer on x [B, T, E]; `attend(q, k, v)` -> (attention output, what the
        layer returns beside x: its cache update). `layer`: p's index in the stacked weights
        (`self.layers`), where p is a slice of them, for a kernel that reads them in place."""
        c = self.config
        p = jax.tree.map(lambda a: a.astype(self.dtype), p)
        b, t, e = x.shape
        if t == 1 and (mode := self._qkv_kernel(b, p, layer)):
            q, k, v = self._fused_qkv(x, p, layer, cos, sin, mode)
        else:
            h = rms_norm(x, p["input_norm"], c.rms_norm_eps).reshape(b * t, e)
            q, k, v = (_dense(h, p, f"{n}_kernel").reshape(b, t, heads, c.head_dim)
                       for n, heads in (("q", c.num_heads), ("k", c.num_kv_heads), ("v", c.num_kv_heads)))
            if c.attention_bias:
                q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
            if c.qk_norm:  # Qwen3: each head normed over head_dim, before the rotation
                q, k = rms_norm(q, p["q_norm"], c.rms_norm_eps), rms_norm(k, p["k_norm"], c.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q = constrain(q, ("batch", "length", "act_heads", "head_dim"))
        k = constrain(k, ("batch", "length", "act_kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "act_kv_heads", "head_dim"))
        out, carry = attend(q, k, v)
        x = x + _dense(out.reshape(b * t, c.num_heads, c.head_dim), p, "o_kernel").reshape(b, t, e)
        # Where the MLP's weights are split over the row groups too (sharding.RULES, `groups`), a
        # decode step gathers its rows to every group (a few MB) and reduce-scatters the output;
        # with many tokens (a prefill, an insert) the rows would outweigh the weights, which are
        # gathered instead.
        if t == 1 and _gathers_rows(b):
            return self._spread_mlp(x, p, layer), carry
        h = rms_norm(x, p["post_norm"], c.rms_norm_eps).reshape(b * t, e)
        out = _mlp(h, p, rows=(b, t)).reshape(b, t, e)
        return constrain(x + out, ("batch", "length", "act_embed")), carry

    def _qkv_kernel(self, b: int, p: dict[str, jax.Array], layer: jax.Array | None) -> str | None:
        """The `decode_kernel` mode in which a one-token step of `b` rows computes its attention
        inputs by `kernels.qkv` (on the stacked weights, layer `layer` of them), or None for XLA."""
        c = self.config
        names = ("q_kernel", "k_kernel", "v_kernel")
        hq, hk = (n // shards(a, n) for n, a in ((c.num_heads, "heads"), (c.num_kv_heads, "kv_heads")))
        applies = (layer is not None and all(k in p for k in names) and shards("embed", c.hidden_size) == 1
                   and all(self.layers[k].dtype == jnp.dtype(self.dtype) for k in names)
                   and qkv.fits(b // shards("batch", b), c.hidden_size, hq + 2 * hk, c.head_dim,
                                       jnp.dtype(self.dtype).itemsize))
        return dispatch.choice("decode_kernel", self.decode_kernel, applies, applies and dispatch.on_tpu(),
                              f"the stacked untransposed weights in the compute dtype, the embedding whole on "
                              f"each device and {b} rows by {hq + 2 * hk} heads of {c.head_dim} in "
                              f"{qkv.VMEM_BUDGET} bytes of VMEM")

    def _fused_qkv(self, x: jax.Array, p: dict[str, jax.Array], layer: jax.Array, cos: jax.Array,
                   sin: jax.Array, mode: str) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k, v [B, 1, H, D] of a one-token step by `kernels.qkv`, each device on its rows and heads."""
        c = self.config
        mesh = jax.sharding.get_abstract_mesh()
        shape = {} if mesh.empty else dict(mesh.shape)
        spec = lambda names, a: logical_to_spec(names, a.shape, shape)
        names = ("q_kernel", "k_kernel", "v_kernel")
        stacked = [self.layers[k][...] for k in names]
        # A model without biases adds zeros: exact, and one kernel for both families.
        biases = [p[k] if c.attention_bias else jnp.zeros(w.shape[2:], self.dtype) for k, w in zip(QKV_BIASES, stacked)]
        norms = [p[k] for k in QK_NORMS] if c.qk_norm else []
        rows = ("batch", "length", None)
        out_axes = [("batch", a, "head_dim") for a in ("act_heads", "act_kv_heads", "act_kv_heads")]

        def local(x, nw, wq, wk, wv, bq, bk, bv, cos, sin, layer, *norms):
            r, t, e = x.shape
            flat = x.reshape(r * t, e)
            return qkv.fused_qkv(flat, rms_scale(flat, c.rms_norm_eps), nw.reshape(1, e), wq, wk, wv,
                                 bq, bk, bv, cos.reshape(r * t, -1), sin.reshape(r * t, -1), layer,
                                 qk_norm=(*norms, c.rms_norm_eps) if norms else None, interpret=mode == "interpret")

        args = (x, p["input_norm"], *stacked, *biases, cos, sin, layer, *norms)
        if mesh.empty:
            out = local(*args)
        else:
            P = jax.sharding.PartitionSpec
            in_specs = (spec(("batch", "length", "act_embed"), x), P(),
                        *(spec(LAYER_PARAMS[k][0], w) for k, w in zip(names, stacked)),
                        *(spec(LAYER_PARAMS[k][0][1:], w) for k, w in zip(QKV_BIASES, biases)),
                        spec(rows, cos), spec(rows, sin), P(), *(P() for _ in norms))
            out_specs = tuple(logical_to_spec(a, (x.shape[0], h, c.head_dim), shape)
                              for a, h in zip(out_axes, (c.num_heads, c.num_kv_heads, c.num_kv_heads)))
            out = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
        return tuple(o[:, None] for o in out)

    def _spread_mlp(self, x: jax.Array, p: dict[str, jax.Array], layer: jax.Array | None) -> jax.Array:
        """The MLP block of a decode step whose rows meet spread weights (`spread_mlp`), by
        `fused_mlp` where `decode_kernel` picks it: on the stacked weights, read in place, where p
        is layer `layer` of them."""
        c = self.config
        m = c.intermediate_size // shards("mlp", c.intermediate_size)
        item = jnp.dtype(self.dtype).itemsize
        applies = "gate_kernel" in p and spread_mlp.fits(x.shape[0], c.hidden_size, m, item)
        mode = dispatch.choice("decode_kernel", self.decode_kernel, applies, applies and dispatch.on_tpu(),
                              f"untransposed weights and {x.shape[0]} rows by {m} intermediate columns in "
                              f"{spread_mlp.VMEM_BUDGET} bytes of VMEM")
        names = [k for k in p if k.removesuffix("_t") in MLP_KERNELS]
        axes = {k: LAYER_PARAMS[k.removesuffix("_t")][0][1:][::-1 if k.endswith("_t") else 1] for k in names}
        weights = {k: p[k] for k in names}
        if mode is None:
            mlp = lambda x, r, w, weights, _: _mlp(spread_mlp.normed(x, r, w), weights)
        else:
            if layer is not None and all(self.layers[k].dtype == jnp.dtype(self.dtype) for k in names):
                weights = {k: self.layers[k][...] for k in names}  # the stacks, not p's slices
                axes = {k: LAYER_PARAMS[k][0] for k in names}
            else:
                layer = None
            mlp = lambda x, r, w, weights, i: spread_mlp.fused_mlp(
                x, r, w, weights["gate_kernel"], weights["up_kernel"], weights["down_kernel"],
                i if layer is not None else None, interpret=mode == "interpret")
        return spread_mlp.spread_mlp(x, p["post_norm"], weights, axes, lambda x: rms_scale(x, c.rms_norm_eps),
                                     mlp, jnp.int32(0) if layer is None else layer)

    def _finish(self, x, cache: KVCache, k, v, t: int, num_new: jax.Array | None) -> tuple[jax.Array, KVCache]:
        x = rms_norm(x, self.final_norm[...], self.config.rms_norm_eps)
        # Writes past the cache's end were dropped (the caller sizes the cache), never clamped.
        step = t if num_new is None else num_new.astype(jnp.int32)
        return x, dataclasses.replace(cache, k=k, v=v, lengths=cache.lengths + step)
