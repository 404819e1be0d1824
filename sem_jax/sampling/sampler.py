"""Compiled sampling: ragged prefill, a `lax.while_loop` decode that pauses rows at
stop strings, and append-prefill of inserted tokens into the same KV cache.

All device work is pure functions of (model state, sampler state); the sampler
state is donated so the KV cache and buffers update in place. The host only
decides *what* to insert (see `rollout.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sem_jax import hosts
from sem_jax.kernels.dispatch import head_candidates, per_layer_default
from sem_jax.model.qwen2 import HEAD_LOGITS_AXES, RESID_AXES, KVCache, Qwen2, cache_axes
from sem_jax.sharding import constrain, logical_to_spec, put, shard_params, shards
from sem_jax.sampling.stop import StopAutomaton


def bucket_length(n: int, minimum: int = 16) -> int:
    """Smallest of 2^k and 3 * 2^(k-1) that holds n (and >= minimum): a logarithmic number of
    shapes (bounded recompiles) with at most a third of padding, not half as powers of two."""
    n = max(int(n), int(minimum), 1)
    p = 1 << (n - 1).bit_length()  # next power of two
    return p * 3 // 4 if p >= 4 and p * 3 // 4 >= n else p


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int  # sampled tokens per response
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    greedy: bool = False
    eos_ids: tuple[int, ...] = ()
    max_inserted_tokens: int = 0  # room for inserted (retrieved) tokens beside the sampled ones

    @property
    def whole_vocabulary(self) -> bool:
        """Greedy, or sampling from the whole (temperature-scaled) distribution: no top-k, top-p."""
        return self.greedy or (not self.top_k and self.top_p == 1.0)

    @property
    def response_tokens(self) -> int:
        """The response buffer (and the cache beyond the prompt): sampled plus inserted tokens."""
        return self.max_new_tokens + self.max_inserted_tokens

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_inserted_tokens < 0:
            raise ValueError(f"max_inserted_tokens must be >= 0, got {self.max_inserted_tokens}")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (or greedy=True), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplerState:
    cache: KVCache
    hidden: jax.Array      # [B, E] compute dtype: each row's final hidden state at its last token
    resp: jax.Array        # [B, R] int32: response tokens (sampled and inserted)
    resp_logprob: jax.Array  # [B, R] float32: sampler logprob (0 on inserted)
    resp_sampled: jax.Array  # [B, R] bool: True on sampled tokens
    resp_len: jax.Array    # [B] int32
    num_sampled: jax.Array  # [B] int32: sampled tokens so far (a row ends at max_new_tokens)
    stop_state: jax.Array  # [B] int32: automaton state
    paused: jax.Array      # [B] bool: wrote a stop string, waits for the host
    eos: jax.Array         # [B] bool: ended by an EOS token
    done: jax.Array        # [B] bool: ended (EOS, length, or by the host); an empty slot is done
    row: jax.Array         # [B] int32: the row (prompt * G + g over every process) a slot decodes; -1: none
    key: jax.Array         # the rollout's key: a row's draw at its n-th sampled token is keyed by (key, row, n)

    @property
    def active(self) -> jax.Array:
        return ~self.done & ~self.paused


def chunk_width(v: int) -> int:
    """The chunk width of the vocabulary walks below (`max_argmax`, `_inverse_cdf`): one that
    divides the vocabulary into a number of chunks that splits evenly over the devices holding
    the logits (`sharding.shards`), so that the [B, chunks, width] view keeps every device's
    shard in place, without padding (a padded copy of the logits made the 0.5B model's sampling
    4-12x slower on CPU). 128 first: the TPU's lanes, and the fastest on CPU. (Qwen2.5-7B's
    152064 over 4 devices at a width of 256: the TPU program gathered half the logits onto every
    device at each decode step.) 256, padded, when nothing divides."""
    for n in dict.fromkeys((shards("act_vocab", v), 1)):
        for width in (128, 256, 64, 32):
            if v % (width * n) == 0:
                return width
    return 256


def max_argmax(x: jax.Array, width: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Row maxima [..., 1] and `jnp.argmax(x, -1)` as int32 (the first maximum) in one pass over
    x: the maxima of chunks of `width` entries (default `chunk_width`), then the first maximum
    inside the first chunk that holds one. (XLA's CPU argmax is a two-operand reduce that does
    not vectorise over a vocabulary; a max pass and then an index pass read the logits twice.) A
    row with NaN gets a NaN's or a maximum's index, always one in range."""
    *lead, v = x.shape
    width = width or chunk_width(v)
    chunks = -(-v // width)
    pad = [(0, 0)] * len(lead) + [(0, chunks * width - v)]
    xc = jnp.pad(x, pad, constant_values=-jnp.inf).reshape(*lead, chunks, width)
    chunk_max = jnp.max(xc, -1)
    top = jnp.max(chunk_max, -1, keepdims=True)

    def first(hit, n):  # index of the first True, n - 1 if none
        iota = jax.lax.broadcasted_iota(jnp.int32, hit.shape, hit.ndim - 1)
        return jnp.min(jnp.where(hit, iota, n - 1), -1)

    c = first((chunk_max == top) | jnp.isnan(chunk_max), chunks)
    block = jnp.take_along_axis(xc, c[..., None, None], -2)[..., 0, :]
    return top, c * width + first((block == top) | jnp.isnan(block), width)


def row_keys(key: jax.Array, rows: jax.Array, position: jax.Array) -> jax.Array:
    """One key per row [B] from the rollout's `key`, each row's id and its token position: a row's
    draws depend on neither its slot, its neighbours nor when it was admitted."""
    return jax.vmap(lambda r, n: jax.random.fold_in(jax.random.fold_in(key, r), n))(rows, position)


def _uniforms(key: jax.Array, b: int) -> jax.Array:
    """[b] uniforms: one per row from per-row keys [b], or b from one key."""
    return jax.vmap(jax.random.uniform)(key) if key.ndim else jax.random.uniform(key, (b,))


def sample_tokens(logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row; returns (ids [B], logprob [B] under the temperature-scaled
    distribution). `key`: one key, or one per row (`row_keys`)."""
    scaled = logits if cfg.greedy else logits / cfg.temperature
    if cfg.whole_vocabulary:
        # Token and log-prob straight from exp(x - max): no [B, V] log-softmax on the way.
        top, tok = max_argmax(scaled) if cfg.greedy else (jnp.max(scaled, -1, keepdims=True), None)
        p = jnp.exp(scaled - top)
        if tok is None:
            tok = _inverse_cdf(p, key)
        picked = jnp.take_along_axis(scaled, tok[:, None], -1)[:, 0]
        return tok, picked - top[:, 0] - jnp.log(jnp.sum(p, -1))
    logp = jax.nn.log_softmax(scaled, -1)
    if cfg.top_k:
        vals, idx = jax.lax.top_k(logp, cfg.top_k)
    else:
        idx = jnp.argsort(-logp, axis=-1)
        vals = jnp.take_along_axis(logp, idx, -1)
    if cfg.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the first token always).
        probs = jnp.exp(vals)
        keep = jnp.cumsum(probs, axis=-1) - probs < cfg.top_p * probs.sum(-1, keepdims=True)
        vals = jnp.where(keep, vals, -jnp.inf)
    tok = jnp.take_along_axis(idx, _inverse_cdf(jnp.exp(vals - vals[:, :1]), key)[:, None], -1)[:, 0]
    return tok.astype(jnp.int32), jnp.take_along_axis(logp, tok[:, None], -1)[:, 0]


def _sum_argmax(a, b):
    """Reducer of (sum, max, index of the first max; a NaN counts as a max) triples."""
    (s1, v1, i1), (s2, v2, i2) = a, b
    first = (v1 > v2) | (v1 != v1) | ((v1 == v2) & (i1 < i2))
    return s1 + s2, jnp.where(first, v1, v2), jnp.where(first, i1, i2)


def _local_candidates(x: jax.Array, key: jax.Array, offset: jax.Array, scale: float, greedy: bool):
    """One device's candidate from its share [B, v] of the logits (token ids offset..): (max,
    sum of exp below it, best score, its id, its logit), all scaled, each [B]. The normaliser and
    the Gumbel-max candidate in one reduction: one pass over the logits."""
    m = jnp.max(x, -1) * scale
    score = x * scale
    if not greedy:
        noise = (jax.vmap(lambda k: jax.random.gumbel(k, x.shape[1:]))(key) if key.ndim
                 else jax.random.gumbel(key, x.shape))
        score = score + noise
    ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    sums, best, j = jax.lax.reduce((jnp.exp(x * scale - m[:, None]), score, ids),
                                   (jnp.float32(0), jnp.float32(-jnp.inf), jnp.int32(0)), _sum_argmax, (1,))
    return m, sums, best, j + offset, jnp.take_along_axis(x, j[:, None], -1)[:, 0] * scale


def sample_spread(logits: jax.Array | None, key: jax.Array, cfg: SamplingConfig,
                  head: tuple[jax.Array, jax.Array, str] | None = None) -> tuple[jax.Array, jax.Array]:
    """`sample_tokens` for logits [B, V] in the LM head's spread layout (`HEAD_LOGITS_AXES`: the
    vocabulary split over every device), where they lie, for a `cfg` that samples from the whole
    vocabulary. Each device draws its share's candidate by the Gumbel-max trick (the argmax of the
    scaled logits plus Gumbel noise of its own) with the softmax's normaliser, and the devices
    compare their candidates, three numbers per row. No logit leaves its device or is copied into
    another layout (handing the 7B's logits to the rows' groups and chunking them for
    `_inverse_cdf` moved 140 MB more per decode step on a v4). Greedy: the first maximum, as
    `sample_tokens`; sampled: a draw from the same distribution as `sample_tokens`, not the same
    draw.

    `head` = (hidden [B, E], the head's weight [E, V], kernel mode): no logits; each device's
    candidate comes from `head_sampling.head_candidates` on its slice of the weight (its noise a
    function of the key, row and token id alone)."""
    if not cfg.whole_vocabulary:
        raise ValueError("sample_spread samples from the whole vocabulary: no top_k or top_p")
    mesh = jax.sharding.get_abstract_mesh()
    shape = (head[0].shape[0], head[1].shape[1]) if head is not None else logits.shape
    spec = jax.sharding.PartitionSpec() if mesh.empty else logical_to_spec(HEAD_LOGITS_AXES, shape, dict(mesh.shape))
    names = lambda a: () if a is None else (a,) if isinstance(a, str) else tuple(a)
    rows, vocab = (names(a) for a in (*spec, None, None)[:2])
    scale = 1.0 if cfg.greedy else 1.0 / cfg.temperature

    def index(axes):  # this device's place along `axes`, 0 without any
        i = 0
        for a in axes:
            i = i * jax.lax.axis_size(a) + jax.lax.axis_index(a)
        return i

    def combine(m, sums, best, tok, picked):
        top = jax.lax.pmax(m, vocab) if vocab else m
        total = sums * jnp.exp(m - top)
        total = jax.lax.psum(total, vocab) if vocab else total
        if vocab:  # the best candidate over the devices, the lowest id on a tie (the first maximum)
            best, tok, picked = (jax.lax.all_gather(c, vocab) for c in (best, tok, picked))
            first = jnp.min(jnp.where(best == jnp.max(best, 0), tok, jnp.iinfo(jnp.int32).max), 0)
            d = jnp.argmax(tok == first, 0)[None]
            tok, picked = (jnp.take_along_axis(c, d, 0)[0] for c in (tok, picked))
        return tok, picked - top - jnp.log(total)

    def local(x, key):
        offset = index(vocab) * x.shape[-1]
        key = (jax.vmap(lambda k: jax.random.fold_in(k, index(vocab)))(key) if key.ndim
               else jax.random.fold_in(key, index(rows + vocab)))
        return combine(*_local_candidates(x, key, offset, scale, cfg.greedy))

    P = jax.sharding.PartitionSpec
    out = P(spec[0] if spec else None)
    key_spec = out if key.ndim else P()  # per-row keys lie with their rows
    if head is None:
        if mesh.empty:
            return local(logits, key)
        return jax.shard_map(local, mesh=mesh, in_specs=(spec, key_spec), out_specs=(out, out),
                             check_vma=False)(logits, key)
    hidden, weight, mode = head

    def local_head(h, w, key):
        if not key.ndim:  # one key: each row's own from it and the row's place among all rows
            key = jax.vmap(lambda r: jax.random.fold_in(key, r))(index(rows) * h.shape[0] + jnp.arange(h.shape[0]))
        seeds = jax.random.key_data(key).reshape(h.shape[0], -1)[:, :2]
        return combine(*head_candidates(h, w, seeds, index(vocab) * w.shape[1], scale=scale, greedy=cfg.greedy,
                                        interpret=mode == "interpret"))

    if mesh.empty:
        return local_head(hidden, weight, key)
    h_spec = P(spec[0] if spec else None)
    w_spec = logical_to_spec(("embed", "head_vocab"), weight.shape, dict(mesh.shape))
    return jax.shard_map(local_head, mesh=mesh, in_specs=(h_spec, w_spec, key_spec), out_specs=(out, out),
                         check_vma=False)(hidden, weight, key)


def _inverse_cdf(probs: jax.Array, key: jax.Array, width: int | None = None) -> jax.Array:
    """Categorical sample per row from unnormalised probabilities [B, V] (a row's largest
    entry > 0) with ONE uniform per row (`key`: one key, or one per row).

    Gumbel-max needs a random number per vocabulary entry (7x slower on CPU than this) and a
    flat cumsum over the vocabulary is slow on CPU; so the CDF is walked in two levels: cumsum
    over chunk sums picks the chunk, a cumsum inside that chunk picks the token. Only these two
    walks see more than [B, chunks] or [B, width] values: no second pass over the vocabulary.
    """
    b, v = probs.shape
    width = width or chunk_width(v)
    chunks = -(-v // width)
    p = jnp.pad(probs, ((0, 0), (0, chunks * width - v))).reshape(b, chunks, width)
    sums = p.sum(-1)
    csum = jnp.cumsum(sums, -1)
    u = _uniforms(key, b) * csum[:, -1]
    c = jnp.minimum(jnp.sum(csum <= u[:, None], -1), chunks - 1)
    # Float rounding can carry a uniform at the top of its range past the last entry with mass
    # (into an empty last chunk, or past a chunk's last nonzero entry): the walk then stops at
    # that last entry, where the CDF reaches its top.
    last = lambda x: jnp.max(jnp.where(x > 0, jax.lax.broadcasted_iota(jnp.int32, x.shape, 1), 0), -1)
    c = jnp.where(jnp.take_along_axis(sums, c[:, None], -1)[:, 0] > 0, c, last(sums))
    rest = u - jnp.take_along_axis(csum - sums, c[:, None], -1)[:, 0]
    block = jnp.take_along_axis(p, c[:, None, None], 1)[:, 0]
    j = jnp.minimum(jnp.sum(jnp.cumsum(block, -1) <= rest[:, None], -1), width - 1)
    j = jnp.where(jnp.take_along_axis(block, j[:, None], -1)[:, 0] > 0, j, last(block))
    return jnp.minimum(c * width + j, v - 1).astype(jnp.int32)


def _extend_last(model: Qwen2, layers, tokens, cache, n, window: int) -> tuple[jax.Array, KVCache]:
    """Append ragged tokens; the hidden state [B, E] at each row's last new token only (the LM
    head over every prompt position would be ~40% of a small model's prefill). The state carries
    it, not its logits: the decode step applies the LM head just before sampling, so no [B, V]
    float32 logits are kept in the state or selected between steps."""
    hidden, cache = model.hidden_states(tokens, cache=cache, num_new=n, window=window, layers=layers)
    return jnp.take_along_axis(hidden, jnp.maximum(n - 1, 0)[:, None, None], 1)[:, 0], cache


def _prefilled(model: Qwen2, layers, prompts, lengths, cache_len: int, cache_dtype,
               resid_layer: int = -1) -> tuple[jax.Array, KVCache]:
    """Each prompt's last hidden state [P, E] and its cache of `cache_len` positions."""
    kept = dict(resid_layer=resid_layer) if resid_layer >= 0 else {}
    cache = model.init_cache(prompts.shape[0], cache_len, cache_dtype, per_layer=layers is not None, **kept)
    return _extend_last(model, layers, prompts, cache, lengths, window=0)  # nothing to read yet


def _prompt_array(prompts: Sequence[Sequence[int]], count: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """`prompts` as [count, width] ids (zero-padded) and their lengths; rows past them are one
    padding token long."""
    arr = np.zeros((count, width), np.int32)
    lengths = np.ones(count, np.int32)
    for i, p in enumerate(prompts):
        arr[i, :len(p)] = p
        lengths[i] = len(p)
    return arr, lengths


def _prefill(graphdef, params, layers, prompts, lengths, key, *, group_size: int, cache_len: int,
             resp_len: int, cache_dtype, resid_layer: int = -1) -> SamplerState:
    """Prefill each prompt once into G rows (row = prompt * G + g, over every process's rows)."""
    model: Qwen2 = nnx.merge(graphdef, params)
    last, cache = _prefilled(model, layers, prompts, lengths, cache_len, cache_dtype, resid_layer)
    # Each prompt is prefilled once; its cache is copied to its G group members.
    b = prompts.shape[0] * group_size
    return _laid_out(SamplerState(
        cache=cache.repeat_rows(group_size), hidden=jnp.repeat(last, group_size, axis=0),
        **_fresh_rows(b, resp_len), done=jnp.zeros((b,), bool), row=jnp.arange(b, dtype=jnp.int32), key=key))


def _fresh_rows(b: int, resp_len: int) -> dict[str, jax.Array]:
    """The per-row fields of rows that have sampled nothing yet."""
    zeros = lambda *shape, dtype=jnp.int32: jnp.zeros(shape, dtype)
    return dict(resp=zeros(b, resp_len), resp_logprob=zeros(b, resp_len, dtype=jnp.float32),
                resp_sampled=zeros(b, resp_len, dtype=bool), resp_len=zeros(b), num_sampled=zeros(b),
                stop_state=zeros(b), paused=zeros(b, dtype=bool), eos=zeros(b, dtype=bool))


def _rows_laid_out(x: jax.Array) -> jax.Array:
    return constrain(x, ("batch",) + ("length",) * (x.ndim - 1))


def _cache_laid_out(cache: KVCache) -> KVCache:
    k_axes, v_axes = cache_axes(cache.per_layer)
    kv = lambda c, axes: jax.tree.map(lambda x: constrain(x, axes), c)
    return dataclasses.replace(cache, k=kv(cache.k, k_axes), v=kv(cache.v, v_axes), lengths=_rows_laid_out(cache.lengths),
                               resid=None if cache.resid is None else constrain(cache.resid, RESID_AXES))


def _laid_out(state: SamplerState) -> SamplerState:
    """Rows split over the batch axes as the prompts were (row = prompt * G + g keeps a process's
    groups on its own devices); decode and insert inherit this layout."""
    fields = {f.name: _rows_laid_out(getattr(state, f.name)) for f in dataclasses.fields(state)
              if f.name not in ("cache", "key")}
    return SamplerState(cache=_cache_laid_out(state.cache), key=state.key, **fields)


def _prompt_cache(graphdef, params, layers, prompts, lengths, *, cache_dtype,
                  resid_layer: int = -1) -> tuple[KVCache, jax.Array]:
    """Each prompt prefilled once, into a cache of its own [P, W], and its last hidden state [P, E]:
    what `_admit` copies into the slots that take the prompt, however many and whenever."""
    last, cache = _prefilled(nnx.merge(graphdef, params), layers, prompts, lengths, prompts.shape[1], cache_dtype,
                             resid_layer)
    return _cache_laid_out(cache), _rows_laid_out(last)


def _empty(graphdef, params, key, *, slots: int, cache_len: int, resp_len: int, cache_dtype,
           per_layer: bool, resid_layer: int = -1) -> SamplerState:
    """`slots` empty slots (done, no row) with a cache of `cache_len` positions each: rows come in
    through `_admit`."""
    model: Qwen2 = nnx.merge(graphdef, params)
    e = model.config.hidden_size
    return _laid_out(SamplerState(
        cache=model.init_cache(slots, cache_len, cache_dtype, per_layer=per_layer,
                               **(dict(resid_layer=resid_layer) if resid_layer >= 0 else {})),
        hidden=jnp.zeros((slots, e), cache_dtype), **_fresh_rows(slots, resp_len), done=jnp.ones((slots,), bool),
        row=jnp.full((slots,), -1, jnp.int32), key=key))


def _admit(state: SamplerState, small: KVCache, last, src, rows) -> SamplerState:
    """Start row `rows[b]` in each slot b with `src[b] >= 0`: prompt `src[b]` of the prompt cache
    (`small` [P, W] and `last` [P, E], `_prompt_cache`) copied into the slot's first W cache
    positions; the slot's response starts empty. Other slots are left as they are."""
    cache = state.cache
    take = src >= 0
    at = jnp.maximum(src, 0)
    w = small.max_length

    def put(big, part, batch_axis, length_axis):  # the first w positions of the taking slots
        part = jnp.take(part, at, axis=batch_axis)
        mask = take.reshape([-1 if a == batch_axis else 1 for a in range(big.ndim)])
        head = jax.lax.slice_in_dim(big, 0, w, axis=length_axis)
        return jax.lax.dynamic_update_slice_in_dim(big, jnp.where(mask, part, head), 0, axis=length_axis)

    if cache.per_layer:
        k = tuple(put(a, b, 0, 3) for a, b in zip(cache.k, small.k))
        v = tuple(put(a, b, 0, 2) for a, b in zip(cache.v, small.v))
    else:
        k, v = put(cache.k, small.k, 1, 2), put(cache.v, small.v, 1, 2)
    resid = None if cache.resid is None else put(cache.resid, small.resid, 0, 1)
    fresh = _fresh_rows(state.resp.shape[0], state.resp.shape[1])
    pick = lambda new, old: jnp.where(take.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)
    return dataclasses.replace(
        state, cache=dataclasses.replace(cache, k=k, v=v, lengths=pick(jnp.take(small.lengths, at), cache.lengths),
                                         resid=resid),
        hidden=pick(jnp.take(last, at, axis=0), state.hidden),
        **{name: pick(x, getattr(state, name)) for name, x in fresh.items() if name not in ("resp", "resp_logprob",
                                                                                           "resp_sampled")},
        done=state.done & ~take, row=jnp.where(take, rows, state.row))


def decode_step(model: Qwen2, layers, s: SamplerState, stop_table, eos_ids, *, cfg: SamplingConfig,
                window: int | None, script: jax.Array | None = None) -> SamplerState:
    """One token for every active row: the decode loop's body. `script` [rows, S] (or None): a
    token forced at each row's first S sampled positions (-1: sampled), its log-prob recorded as 0
    (scripted workloads for benchmarks and tests)."""
    rows = jnp.arange(s.resp.shape[0])
    sub = row_keys(s.key, s.row, s.num_sampled)
    active = s.active
    spread = cfg.whole_vocabulary and model.spreads_head(rows.shape[0])
    mode = model.head_kernel_mode(rows.shape[0]) if spread else None
    if mode:
        tok, logprob = sample_spread(None, sub, cfg, head=(s.hidden, model.lm_head_weight(), mode))
    else:
        tok, logprob = (sample_spread if spread else sample_tokens)(
            model.logits(s.hidden, keep_head_layout=spread), sub, cfg)
    if script is not None:
        n = s.num_sampled
        scripted = (n < script.shape[1]) & (s.row >= 0) & (s.row < script.shape[0])
        forced = jnp.where(scripted, script[jnp.clip(s.row, 0, script.shape[0] - 1),
                                            jnp.minimum(n, script.shape[1] - 1)], -1)
        tok, logprob = jnp.where(forced >= 0, forced, tok), jnp.where(forced >= 0, 0.0, logprob)
    at = jnp.where(active, s.resp_len, s.resp.shape[1])  # inactive rows write nowhere
    resp = s.resp.at[rows, at].set(tok, mode="drop")
    resp_logprob = s.resp_logprob.at[rows, at].set(logprob, mode="drop")
    resp_sampled = s.resp_sampled.at[rows, at].set(True, mode="drop")
    resp_len = s.resp_len + active
    num_sampled = s.num_sampled + active
    code = stop_table[tok, s.stop_state]
    stop_state = jnp.where(active, code >> 1, s.stop_state)
    eos = active & jnp.isin(tok, eos_ids)
    done = s.done | eos | (active & ((num_sampled >= cfg.max_new_tokens) | (resp_len >= s.resp.shape[1])))
    paused = s.paused | (active & ~done & ((code & 1) == 1))
    hidden, cache = model.hidden_states(tok[:, None], cache=s.cache, num_new=active.astype(jnp.int32),
                                        window=window, layers=layers)
    return SamplerState(
        cache=cache, hidden=jnp.where(active[:, None], hidden[:, 0], s.hidden), resp=resp,
        resp_logprob=resp_logprob, resp_sampled=resp_sampled, resp_len=resp_len, num_sampled=num_sampled,
        stop_state=stop_state, paused=paused, eos=s.eos | eos, done=done, row=s.row, key=s.key)


def _decode(graphdef, params, layers, state: SamplerState, stop_table, eos_ids, max_steps, script=None,
            release=None, *, cfg: SamplingConfig, window: int) -> tuple[SamplerState, jax.Array]:
    """Decode until every row is done or paused, after `max_steps` steps, before an active row
    would read past the first `window` cache slots, or, given `release` ([2] int32: counts of
    pauses and of ends, 0 for never), once that many of the rows active at the start have paused
    or that many have ended. Returns the state and `progress` after (with the active row-steps it
    decoded and the rows that paused and ended)."""
    model: Qwen2 = nnx.merge(graphdef, params)
    full = state.cache
    started = state.active

    def stopped(s):  # [paused, ended]: rows active at the start that now wait for the host, or are done
        gone = started & ~s.active
        return jnp.stack([jnp.sum(gone & ~s.done, dtype=jnp.int32), jnp.sum(gone & s.done, dtype=jnp.int32)])
    # A per-layer cache decodes in a copy of the slots the loop can touch (the window and the
    # slot each step writes), copied back after it: a window sliced out of the whole cache at
    # every step is a copy of its own on XLA:CPU (a strided slice feeds no dot in place).
    span = window + 1
    buffered = full.per_layer and span < full.max_length
    if buffered:
        state = dataclasses.replace(state, cache=dataclasses.replace(
            full, k=tuple(k[..., :span] for k in full.k), v=tuple(v[:, :, :span] for v in full.v),
            resid=None if full.resid is None else full.resid[:, :span]))

    def cond(carry):
        step, _, s = carry
        go = (step < max_steps) & jnp.any(s.active) & ~jnp.any(s.active & (s.cache.lengths > window))
        return go if release is None else go & ~jnp.any((release > 0) & (stopped(s) >= release))

    def body(carry):
        step, busy, s = carry
        return step + 1, busy + jnp.sum(s.active, dtype=jnp.int32), decode_step(
            model, layers, s, stop_table, eos_ids, cfg=cfg, window=None if buffered else window, script=script)

    steps, busy, state = jax.lax.while_loop(cond, body, (jnp.int32(0), jnp.int32(0), state))
    if buffered:
        back = lambda whole, part: tuple(jax.lax.dynamic_update_slice(w, p, (0,) * w.ndim) for w, p in zip(whole, part))
        resid = None if full.resid is None else back((full.resid,), (state.cache.resid,))[0]
        state = dataclasses.replace(state, cache=dataclasses.replace(
            full, k=back(full.k, state.cache.k), v=back(full.v, state.cache.v), lengths=state.cache.lengths,
            resid=resid))
    return state, _progress(state, steps, busy, stopped(state))


def _progress(state: SamplerState, steps=0, busy=0, stopped=(0, 0)) -> jax.Array:
    """[steps, longest active row's cache length (-1: none active), longest live row's, active
    row-steps decoded, rows that paused, rows that ended (`_decode`'s release)]: what the host
    needs to pick the next call's attention window, in one small transfer."""
    lengths = state.cache.lengths
    return jnp.stack([jnp.int32(steps), jnp.max(jnp.where(state.active, lengths, -1)),
                      jnp.max(jnp.where(state.done, 0, lengths)), jnp.int32(busy), *jnp.asarray(stopped, jnp.int32)])


# Tokens per pass of an insert: a pass materialises its attention scores, [rows, heads, chunk,
# window] float32 (a search's 5 passages are up to 768 tokens: one pass of them needed 16.4 GiB of
# temporaries per v4 device at the 7B config's 80 rows per tensor-parallel group, 128 need 2.5).
INSERT_CHUNK = 128


def _insert(graphdef, params, layers, state: SamplerState, ids, n, end_rows, resume=None, *, window: int,
            chunk: int = INSERT_CHUNK) -> SamplerState:
    """Append `ids[b, :n[b]]` to row b (cache and response, loss mask 0), unpause the rows in
    `resume` (None: every row), and end the rows in `end_rows`. The tokens go in `chunk` at a
    time, each pass reading the cache up to what the passes before it wrote."""
    model: Qwen2 = nnx.merge(graphdef, params)
    return _append(model, layers, state, None, ids, n, end_rows, resume, window, chunk)


def _refill(graphdef, params, layers, state: SamplerState, sel, ids, n, end_rows, resume, admit, *,
            window: int, chunk: int = INSERT_CHUNK) -> SamplerState:
    """One boundary's device work in one call: `_insert`'s appends (to the slots `sel` only, when
    given: ids [k, W] for slots sel [k], an index past the slots for padding) and ends, then
    `_admit`'s new rows (`admit`: the prompt cache, each slot's prompt and row, or None)."""
    model: Qwen2 = nnx.merge(graphdef, params)
    state = _append(model, layers, state, sel, ids, n, end_rows, resume, window, chunk)
    return state if admit is None else _admit(state, *admit)


def _rows_of(cache: KVCache, sel) -> KVCache:
    axis = 0 if cache.per_layer else 1
    take = lambda x: jnp.take(x, sel, axis=axis, mode="clip")
    return dataclasses.replace(cache, k=jax.tree.map(take, cache.k), v=jax.tree.map(take, cache.v),
                               lengths=jnp.take(cache.lengths, sel, mode="clip"),
                               resid=None if cache.resid is None else jnp.take(cache.resid, sel, axis=0, mode="clip"))


def _put_rows(cache: KVCache, sel, part: KVCache) -> KVCache:
    def put(x, y):
        return x.at[sel].set(y, mode="drop") if cache.per_layer else x.at[:, sel].set(y, mode="drop")
    return dataclasses.replace(cache, k=jax.tree.map(put, cache.k, part.k), v=jax.tree.map(put, cache.v, part.v),
                               lengths=cache.lengths.at[sel].set(part.lengths, mode="drop"),
                               resid=None if cache.resid is None else cache.resid.at[sel].set(part.resid, mode="drop"))


def _append(model: Qwen2, layers, state: SamplerState, sel, ids, n, end_rows, resume, window: int,
            chunk: int) -> SamplerState:
    """`_insert` on the slots `sel` (None: every slot, ids [B, W]): a boundary that answers a
    few rows computes their tokens only, not every slot's padding."""
    b = state.resp.shape[0]
    rows = jnp.arange(b) if sel is None else sel
    keep = lambda x: jnp.take(x, rows, axis=0, mode="clip")
    last, cache = None, state.cache if sel is None else _rows_of(state.cache, sel)
    for start in range(0, ids.shape[1], chunk):
        part = jnp.clip(n - start, 0, chunk)
        hidden, cache = _extend_last(model, layers, ids[:, start:start + chunk], cache, part,
                                     min(window + start, cache.max_length))
        last = hidden if last is None else jnp.where((part > 0)[:, None], hidden, last)
    if sel is not None:
        cache = _put_rows(state.cache, sel, cache)
    width = state.resp.shape[1]
    cols = keep(state.resp_len)[:, None] + jnp.arange(ids.shape[1])[None, :]
    cols = jnp.where(jnp.arange(ids.shape[1])[None, :] < n[:, None], cols, width)  # drop padding
    got = n > 0
    resp_len = state.resp_len.at[rows].add(n, mode="drop")
    return dataclasses.replace(
        state, cache=cache, hidden=state.hidden.at[rows].set(jnp.where(got[:, None], last, keep(state.hidden)),
                                                             mode="drop"),
        resp=state.resp.at[rows[:, None], cols].set(ids, mode="drop"),
        resp_logprob=state.resp_logprob.at[rows[:, None], cols].set(0.0, mode="drop"),
        resp_sampled=state.resp_sampled.at[rows[:, None], cols].set(False, mode="drop"),
        resp_len=resp_len, stop_state=state.stop_state.at[rows].set(jnp.where(got, 0, keep(state.stop_state)),
                                                                    mode="drop"),
        paused=jnp.zeros_like(state.paused) if resume is None else state.paused & ~resume,
        done=state.done | end_rows | (resp_len >= width))


def _take_slots(state: SamplerState, sel) -> SamplerState:
    """The slots `sel` [k] of `state`, in that order: a narrower decode batch of the same rows."""
    fields = {f.name: jnp.take(getattr(state, f.name), sel, axis=0) for f in dataclasses.fields(state)
              if f.name not in ("cache", "key")}
    return _laid_out(SamplerState(cache=_rows_of(state.cache, sel), key=state.key, **fields))


def _wider(x, dtype: jnp.dtype) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize > dtype.itemsize


def compute_weights(params: Any, dtype: Any) -> Any:
    """`params` with floating weights wider than `dtype` cast to it (others as they are; the same
    tree when none is): every use in `Qwen2` casts a weight to the compute dtype first, so
    sampling from the cast copy gives the same values while each decode step reads (and an FSDP
    mesh gathers) half the bytes of float32 master weights."""
    dtype = jnp.dtype(dtype)
    if not any(_wider(x, dtype) for x in jax.tree.leaves(params)):
        return params
    return _cast_wider(params, dtype)


@partial(jax.jit, static_argnums=1)
def _cast_wider(params, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if _wider(x, dtype) else x, params)


# The compiled step functions (graph definition static; weights and state as arguments, the
# state donated). Module-level so that compile-only checks can lower them without a Sampler.
prefill_step = jax.jit(_prefill, static_argnums=0,
                       static_argnames=("group_size", "cache_len", "resp_len", "cache_dtype", "resid_layer"))
decode_loop = jax.jit(_decode, static_argnums=0, static_argnames=("cfg", "window"), donate_argnums=3)
insert_step = jax.jit(_insert, static_argnums=0, static_argnames=("window", "chunk"), donate_argnums=3)
refill_step = jax.jit(_refill, static_argnums=0, static_argnames=("window", "chunk"), donate_argnums=3)
prompt_cache = jax.jit(_prompt_cache, static_argnums=0, static_argnames=("cache_dtype", "resid_layer"))
empty_state = jax.jit(_empty, static_argnums=0,
                      static_argnames=("slots", "cache_len", "resp_len", "cache_dtype", "per_layer", "resid_layer"))
layer_list = jax.jit(lambda graphdef, params: nnx.merge(graphdef, params).layer_list(transposed=True),
                     static_argnums=0)
progress = jax.jit(_progress)
take_slots = jax.jit(_take_slots)  # not donated: its output is narrower, no buffer could be reused


class Sampler:
    """Batched sampler over a `Qwen2`: `start` (prefill), `decode`, `insert`.

    Recompiles are bounded: prompt length, insert width and the attention window are
    bucketed (`bucket_length`); the batch size and response budget are fixed by the caller.

    Attention reads only a window of the KV cache that grows with the longest row, in steps
    of at least `window_steps` tokens (each window size compiles once); 0 reads the whole
    cache (sized for the full response budget) at every step, with a single compile.

    `per_layer` (default: `per_layer_default(sampler=True)`: on CPUs and GPUs) keeps a copy of each
    layer's weights as arrays of their own ([out, in] kernels) and a per-layer KV cache (see
    `Qwen2.hidden_states`): a faster decode there for one more copy of the layer weights.

    With a `mesh`, rows are sharded over its batch axes and each process passes (and gets
    back, through `local`) only its own rows; widths are agreed between processes so that
    every process makes the same compiled calls (`sem_jax.hosts`). The weights are placed in the
    mesh's layout by their logical axes, whatever layout they arrive in.

    `resid_layer` >= 0 (per-layer only): the cache keeps the residual stream entering that layer
    at every position (`KVCache.resid`), for a LoRA update that starts there (`resid_of`).
    """

    def __init__(self, model: Qwen2, stop: StopAutomaton, cfg: SamplingConfig,
                 max_steps_per_call: int | None = None, mesh: jax.sharding.Mesh | None = None,
                 calls: hosts.CallLog | None = None, window_steps: int = 32, per_layer: bool | None = None,
                 max_prompt_tokens: int | None = None, insert_chunk: int = INSERT_CHUNK, resid_layer: int = -1):
        self.graphdef, params = nnx.split(model)
        self.cache_dtype = model.dtype
        self.mesh = mesh
        self.max_prompt_tokens = max_prompt_tokens  # longer prompts are refused, not compiled for
        self.per_layer = per_layer_default(sampler=True) if per_layer is None else per_layer
        self.resid_layer = resid_layer if self.per_layer else -1  # the layer scan keeps no residual
        self.set_params(params)
        self.config = cfg
        self.calls = calls or hosts.CallLog(False)
        vocab = model.config.vocab_size
        table = stop.table
        if table.shape[0] < vocab:  # model rows past the tokenizer: no bytes, no state change
            pad = np.repeat(np.arange(table.shape[1], dtype=np.int32)[None] * 2, vocab - table.shape[0], 0)
            table = np.concatenate([table, pad])
        self.stop_table = self.replicated(table[:vocab])
        self.eos_ids = self.replicated(np.array(cfg.eos_ids or [-1], np.int32))
        self.max_steps = max_steps_per_call or cfg.max_new_tokens
        self.window_steps = window_steps
        self.insert_chunk = insert_chunk

    def replicated(self, x: np.ndarray | jax.Array) -> jax.Array:
        """`x` whole on every device of the mesh (as an array, as it is, without a mesh)."""
        if self.mesh is None:
            return x if isinstance(x, jax.Array) else jnp.asarray(x)
        return put(x, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))

    def _rows(self, local: np.ndarray) -> jax.Array:
        return jnp.asarray(local) if self.mesh is None else hosts.to_global(local, self.mesh)

    def local(self, x: jax.Array) -> np.ndarray:
        """This process's rows of a state field (all rows without a mesh)."""
        return np.asarray(x) if self.mesh is None else hosts.to_local(x)

    def row_multiple(self) -> int:
        """Each process's row count must be a multiple of this (its share of the batch shards)."""
        return 1 if self.mesh is None else hosts.local_batch_multiple(self.mesh)

    def set_params(self, params: Any) -> None:
        """Use new policy weights (same structure) for the next rollouts: in the compute dtype and,
        with a mesh, in its layout (a no-op where they already are: the sampler's mesh may differ
        from the trainer's, `sem_jax.assemble.build_rollout_mesh`)."""
        params = compute_weights(params, self.cache_dtype)
        with self._on_mesh():
            self.params = params if self.mesh is None else shard_params(params, self.mesh)
            self.layers = layer_list(self.graphdef, self.params) if self.per_layer else None

    def _on_mesh(self):
        """The sampler's mesh as the ambient one (the model's sharding constraints name it), whatever
        mesh the caller runs under."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def release(self) -> None:
        """Drop the weights and their per-layer copies (a model's worth of memory on the CPU path)
        while the trainer updates them; `set_params` before the next use."""
        self.params = self.layers = None

    def start(self, prompts: Sequence[Sequence[int]], group_size: int, key: jax.Array) -> SamplerState:
        """Prefill each prompt once and copy it to `group_size` rows (row = prompt * G + g)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if self.max_prompt_tokens is not None:
            over = [(i, len(p)) for i, p in enumerate(prompts) if len(p) > self.max_prompt_tokens]
            if over:
                raise ValueError(f"prompt {over[0][0]} has {over[0][1]} tokens, over data.max_prompt_tokens="
                                 f"{self.max_prompt_tokens} ({len(over)} of {len(prompts)} prompts are): "
                                 "skip such questions at load (assemble.cap_prompts) or raise the cap")
        width = hosts.agree_max(bucket_length(max(len(p) for p in prompts)))
        arr, lengths = _prompt_array(prompts, len(prompts), width)
        key = self.replicated(key)
        self.calls.record("prefill", arr)
        with self._on_mesh():
            return prefill_step(self.graphdef, self.params, self.layers, self._rows(arr), self._rows(lengths), key,
                                group_size=group_size, cache_len=width + self.config.response_tokens,
                                resp_len=self.config.response_tokens, cache_dtype=self.cache_dtype,
                                resid_layer=self.resid_layer)

    def _window(self, state: SamplerState, need: int) -> int:
        """Cache slots attention reads when rows hold up to `need` (a bucket, at most all)."""
        full = state.cache.max_length
        return full if not self.window_steps else min(full, bucket_length(need))

    def empty(self, slots: int, prompt_width: int, key: jax.Array) -> SamplerState:
        """`slots` empty decode slots (this process's; a multiple of `row_multiple`) whose cache
        holds a prompt of up to `prompt_width` tokens and a whole response; `refill` admits rows."""
        with self._on_mesh():
            return empty_state(self.graphdef, self.params, self.replicated(key),
                               slots=slots * jax.process_count(), cache_len=prompt_width + self.config.response_tokens,
                               resp_len=self.config.response_tokens, cache_dtype=self.cache_dtype,
                               per_layer=self.per_layer, resid_layer=self.resid_layer)

    def decode(self, state: SamplerState, max_steps: int | None = None,
               script: jax.Array | None = None) -> SamplerState:
        """Sample until every row is done or paused at a stop string, or after `max_steps` steps
        (default `max_steps_per_call`). `script` (`decode_step`) forces tokens. Donates `state`."""
        return self.decode_counted(state, max_steps, script)[0]

    def decode_counted(self, state: SamplerState, max_steps: int | None = None, script: jax.Array | None = None,
                       pauses: int = 0, ends: int = 0) -> tuple[SamplerState, int, int]:
        """`decode`, with the decode steps it ran and the active row-steps among them (all
        processes'). Back as soon as `pauses` of the rows active at the start have paused (a query
        to send) or `ends` of them have ended (slots to refill, or a batch to narrow); 0: never for
        that kind."""
        top = int(np.asarray(progress(state))[1])
        left = max_steps or self.max_steps
        steps = busy = 0
        release = np.array([pauses, ends], np.int32)
        while top >= 0 and left > 0:  # a row is active
            window = self._window(state, top + self.window_steps)
            self.calls.record(f"decode@{window}", state.resp)
            with self._on_mesh():
                state, info = decode_loop(self.graphdef, self.params, self.layers, state, self.stop_table,
                                          self.eos_ids, self.replicated(np.int32(left)), script,
                                          self.replicated(release) if release.any() else None,
                                          cfg=self.config, window=window)
            done, top, _, active, *stopped = np.asarray(info).tolist()
            left -= done
            steps += done
            busy += active
            if release.any():
                wanted = release > 0
                release = np.where(wanted, release - np.array(stopped, np.int32), 0)
                if (wanted & (release <= 0)).any():
                    break
            if done == 0:  # cannot happen with a window past the longest active row
                raise RuntimeError(f"decode made no progress: window {window}, longest active row {top}")
        return state, steps, busy

    def insert(self, state: SamplerState, blocks: Sequence[Sequence[int]],
               end_rows: Sequence[bool] | None = None) -> SamplerState:
        """Append `blocks[b]` (may be empty) to each row and resume every row; `end_rows` rows end
        instead. Donates `state`."""
        return self.refill(state, blocks, end_rows)

    def refill(self, state: SamplerState, blocks: Sequence[Sequence[int]], end_rows: Sequence[bool] | None = None,
               resume: Sequence[bool] | None = None,
               admit: Sequence[tuple[int, int, int]] = (), prompts: tuple[KVCache, jax.Array] | None = None,
               sizes: Sequence[int] | None = None) -> SamplerState:
        """One host boundary's device work, in one call: append `blocks[b]` (may be empty) to slot
        b, resume the slots in `resume` (default: all), end the slots in `end_rows`, and admit
        rows: (slot, prompt index in `prompts`, row id) each, `prompts` being `prefill_prompts`'s
        cache (copied into the slots; no prefill here). This process's slots; every process calls
        it (with nothing to do, if so). `sizes`: `refill_sizes` already agreed between processes (the
        engine's boundary exchange); None agrees them here. Donates `state`."""
        b = len(blocks)
        end = np.zeros(b, bool) if end_rows is None else np.asarray(end_rows, bool)
        longest = int(np.asarray(progress(state))[2]) if self.window_steps else 0  # no sync without windows
        window = self._window(state, longest)
        some = [i for i, blk in enumerate(blocks) if len(blk)]
        k, width, admitting = sizes or hosts.agree_max_each(*self.refill_sizes(blocks, admit))
        rows = list(range(b)) if k >= b else some + [None] * (k - len(some))  # None: padding
        ids = np.zeros((len(rows), width), np.int32)
        n = np.zeros(len(rows), np.int32)
        for j, i in enumerate(rows):
            if i is not None:
                ids[j, :len(blocks[i])] = blocks[i]
                n[j] = len(blocks[i])
        self.calls.record(f"insert@{window}", ids)
        resume = None if resume is None else self._rows(np.asarray(resume, bool))
        if k >= b and not admitting:  # every slot: the batch insert (what aot compiles)
            with self._on_mesh():
                return insert_step(self.graphdef, self.params, self.layers, state, self._rows(ids), self._rows(n),
                                   self._rows(end), resume, window=window, chunk=self.insert_chunk)
        total = b * jax.process_count()  # a global slot index past the last: padding, dropped
        first = jax.process_index() * b
        sel = None if k >= b else self._rows(np.array([total if i is None else first + i for i in rows], np.int32))
        arrays = None
        if admitting:
            if prompts is None:
                raise ValueError("refill admits rows from a prompt cache: pass prompts=prefill_prompts(...)")
            src, rows_of = self._admissions(b, admit, prompts[1].shape[0] // jax.process_count())
            arrays = (*prompts, self._rows(src), self._rows(rows_of))
            self.calls.record("admit", src)
        with self._on_mesh():
            return refill_step(self.graphdef, self.params, self.layers, state, sel, self._rows(ids), self._rows(n),
                               self._rows(end), resume, arrays, window=window, chunk=self.insert_chunk)

    def refill_sizes(self, blocks: Sequence[Sequence[int]], admit: Sequence[tuple[int, int, int]]
                     ) -> tuple[int, int, int]:
        """This process's shapes for `refill`: the slots appended to (bucketed), the blocks' width
        and the admissions. Every process must call `refill` with their largest over all processes."""
        lengths = [len(blk) for blk in blocks if len(blk)]
        k = -(-bucket_length(max(len(lengths), 1), minimum=1) // self.row_multiple()) * self.row_multiple()
        return k, bucket_length(max(lengths + [1]), minimum=8), len(admit)

    def _admissions(self, b: int, admit: Sequence[tuple[int, int, int]], per: int) -> tuple[np.ndarray, np.ndarray]:
        """`refill`'s admissions as arrays: each slot's prompt (its global index in the prompt
        cache, `per` prompts a process; -1: none) and row id."""
        src, rows = np.full(b, -1, np.int32), np.full(b, -1, np.int32)
        for slot, p, row in admit:
            src[slot], rows[slot] = jax.process_index() * per + p, row
        return src, rows

    def prefill_prompts(self, prompts: Sequence[Sequence[int]], width: int) -> tuple[KVCache, jax.Array]:
        """Each of this process's `prompts` prefilled once (`width` tokens of room, the slots'
        prompt room): the cache `refill` admits rows from, so that a group whose rows are admitted
        at different boundaries is not prefilled again. Every process passes the same count."""
        per = -(-len(prompts) // self.row_multiple()) * self.row_multiple()
        arr, lengths = _prompt_array(prompts, per, width)  # padding prompts are never admitted
        self.calls.record("prefill prompts", arr)
        with self._on_mesh():
            return prompt_cache(self.graphdef, self.params, self.layers, self._rows(arr), self._rows(lengths),
                                cache_dtype=self.cache_dtype, resid_layer=self.resid_layer)

    def can_narrow(self) -> bool:
        """Whether `narrow` keeps every row on its device: one process, a batch that is not split."""
        return jax.process_count() == 1 and (self.mesh is None or hosts.batch_shards(self.mesh) == 1)

    def narrow(self, state: SamplerState, keep: Sequence[int]) -> SamplerState:
        """A state of `len(keep)` slots: slot j holds what slot `keep[j]` held (cache, response,
        flags); the rows decode on as they would have (their draws are keyed by row, not slot)."""
        if not self.can_narrow():
            raise ValueError("narrow needs one process and an unsplit batch (can_narrow)")
        self.calls.record("narrow", np.asarray(keep))
        with self._on_mesh():
            return take_slots(state, self.replicated(np.asarray(keep, np.int32)))

    def flags(self, state: SamplerState) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This process's slots' (paused, done, response length)."""
        return tuple(self.local(x) for x in (state.paused, state.done, state.resp_len))
