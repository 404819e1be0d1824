"""Compiled sampling: ragged prefill, a `lax.while_loop` decode that pauses rows at
stop strings, and append-prefill of inserted tokens into the same KV cache.

All device work is pure functions of (model state, sampler state); the sampler
state is donated so the KV cache and buffers update in place. The host only
decides *what* to insert (see `rollout.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sem_jax.model.qwen2 import KVCache, Qwen2
from sem_jax.sampling.stop import StopAutomaton


def next_pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int  # response budget: sampled plus inserted tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    greedy: bool = False
    eos_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (or greedy=True), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplerState:
    cache: KVCache
    logits: jax.Array      # [B, V] float32: next-token logits of each row
    resp: jax.Array        # [B, R] int32: response tokens (sampled and inserted)
    resp_logprob: jax.Array  # [B, R] float32: sampler logprob (0 on inserted)
    resp_sampled: jax.Array  # [B, R] bool: True on sampled tokens
    resp_len: jax.Array    # [B] int32
    stop_state: jax.Array  # [B] int32: automaton state
    paused: jax.Array      # [B] bool: wrote a stop string, waits for the host
    eos: jax.Array         # [B] bool: ended by an EOS token
    done: jax.Array        # [B] bool: ended (EOS, length, or by the host)
    key: jax.Array

    @property
    def active(self) -> jax.Array:
        return ~self.done & ~self.paused


def sample_tokens(logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row; returns (ids [B], logprob [B] under the temperature-scaled distribution)."""
    if cfg.greedy:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        scaled = logits
    else:
        scaled = logits / cfg.temperature
        if cfg.top_k or cfg.top_p < 1.0:
            vals, idx = (jax.lax.top_k(scaled, cfg.top_k) if cfg.top_k else
                         (lambda i: (jnp.take_along_axis(scaled, i, -1), i))(jnp.argsort(-scaled, -1)))
            if cfg.top_p < 1.0:
                probs = jax.nn.softmax(vals, axis=-1)
                # Keep the smallest prefix whose mass reaches top_p (the first token always).
                keep = jnp.cumsum(probs, axis=-1) - probs < cfg.top_p
                vals = jnp.where(keep, vals, -jnp.inf)
            pick = jax.random.categorical(key, vals, axis=-1)
            tok = jnp.take_along_axis(idx, pick[:, None], -1)[:, 0].astype(jnp.int32)
        else:
            tok = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
    logprob = jnp.take_along_axis(jax.nn.log_softmax(scaled, -1), tok[:, None], -1)[:, 0]
    return tok, logprob


def _prefill(graphdef, params, prompts, lengths, key, *, group_size: int, cache_len: int,
             resp_len: int, cache_dtype) -> SamplerState:
    model: Qwen2 = nnx.merge(graphdef, params)
    p = prompts.shape[0]
    cache = model.init_cache(p, cache_len, cache_dtype)
    logits, cache = model.extend(prompts, cache, lengths)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], 1)[:, 0]
    # Each prompt is prefilled once; its cache is copied to its G group members.
    rep = lambda x, axis: jnp.repeat(x, group_size, axis=axis)
    cache = KVCache(k=rep(cache.k, 1), v=rep(cache.v, 1), lengths=rep(cache.lengths, 0))
    b = p * group_size
    return SamplerState(
        cache=cache, logits=rep(last, 0),
        resp=jnp.zeros((b, resp_len), jnp.int32), resp_logprob=jnp.zeros((b, resp_len), jnp.float32),
        resp_sampled=jnp.zeros((b, resp_len), bool), resp_len=jnp.zeros((b,), jnp.int32),
        stop_state=jnp.zeros((b,), jnp.int32), paused=jnp.zeros((b,), bool),
        eos=jnp.zeros((b,), bool), done=jnp.zeros((b,), bool), key=key)


def _decode(graphdef, params, state: SamplerState, stop_table, eos_ids, *,
            cfg: SamplingConfig, max_steps: int) -> SamplerState:
    """Decode until every row is done or paused (or `max_steps` steps)."""
    model: Qwen2 = nnx.merge(graphdef, params)
    rows = jnp.arange(state.resp.shape[0])

    def cond(carry):
        step, s = carry
        return (step < max_steps) & jnp.any(s.active)

    def body(carry):
        step, s = carry
        key, sub = jax.random.split(s.key)
        active = s.active
        tok, logprob = sample_tokens(s.logits, sub, cfg)
        at = jnp.where(active, s.resp_len, s.resp.shape[1])  # inactive rows write nowhere
        resp = s.resp.at[rows, at].set(tok, mode="drop")
        resp_logprob = s.resp_logprob.at[rows, at].set(logprob, mode="drop")
        resp_sampled = s.resp_sampled.at[rows, at].set(True, mode="drop")
        resp_len = s.resp_len + active
        code = stop_table[tok, s.stop_state]
        stop_state = jnp.where(active, code >> 1, s.stop_state)
        eos = active & jnp.isin(tok, eos_ids)
        done = s.done | eos | (active & (resp_len >= s.resp.shape[1]))
        paused = s.paused | (active & ~done & ((code & 1) == 1))
        logits, cache = model.extend(tok[:, None], s.cache, active.astype(jnp.int32))
        return step + 1, SamplerState(
            cache=cache, logits=jnp.where(active[:, None], logits[:, 0], s.logits), resp=resp,
            resp_logprob=resp_logprob, resp_sampled=resp_sampled, resp_len=resp_len,
            stop_state=stop_state, paused=paused, eos=s.eos | eos, done=done, key=key)

    _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    return state


def _insert(graphdef, params, state: SamplerState, ids, n, end_rows) -> SamplerState:
    """Append `ids[b, :n[b]]` to row b (cache and response, loss mask 0), unpause every row,
    and end the rows in `end_rows`."""
    model: Qwen2 = nnx.merge(graphdef, params)
    logits, cache = model.extend(ids, state.cache, n)
    last = jnp.take_along_axis(logits, jnp.maximum(n - 1, 0)[:, None, None], 1)[:, 0]
    width = state.resp.shape[1]
    cols = state.resp_len[:, None] + jnp.arange(ids.shape[1])[None, :]
    cols = jnp.where(jnp.arange(ids.shape[1])[None, :] < n[:, None], cols, width)  # drop padding
    rows = jnp.arange(ids.shape[0])[:, None]
    resp_len = state.resp_len + n
    got = n > 0
    return dataclasses.replace(
        state, cache=cache, logits=jnp.where(got[:, None], last, state.logits),
        resp=state.resp.at[rows, cols].set(ids, mode="drop"),
        resp_logprob=state.resp_logprob.at[rows, cols].set(0.0, mode="drop"),
        resp_sampled=state.resp_sampled.at[rows, cols].set(False, mode="drop"),
        resp_len=resp_len, stop_state=jnp.where(got, 0, state.stop_state),
        paused=jnp.zeros_like(state.paused), done=state.done | end_rows | (resp_len >= width))


class Sampler:
    """Batched sampler over a `Qwen2`: `start` (prefill), `decode`, `insert`, `fetch`.

    Recompiles are bounded: prompt length and insert width are bucketed to powers
    of two; the batch size and response budget are fixed by the caller.
    """

    def __init__(self, model: Qwen2, stop: StopAutomaton, cfg: SamplingConfig,
                 max_steps_per_call: int | None = None):
        self.graphdef, self.params = nnx.split(model)
        self.config = cfg
        self.cache_dtype = model.dtype
        vocab = model.config.vocab_size
        table = stop.table
        if table.shape[0] < vocab:  # model rows past the tokenizer: no bytes, no state change
            pad = np.repeat(np.arange(table.shape[1], dtype=np.int32)[None] * 2, vocab - table.shape[0], 0)
            table = np.concatenate([table, pad])
        self.stop_table = jnp.asarray(table[:vocab])
        self.eos_ids = jnp.asarray(np.array(cfg.eos_ids or [-1], np.int32))
        self.max_steps = max_steps_per_call or cfg.max_new_tokens
        self._prefill = jax.jit(_prefill, static_argnums=0,
                                static_argnames=("group_size", "cache_len", "resp_len", "cache_dtype"))
        self._decode = jax.jit(_decode, static_argnums=0, static_argnames=("cfg", "max_steps"),
                               donate_argnums=2)
        self._insert = jax.jit(_insert, static_argnums=0, donate_argnums=2)

    def set_params(self, params: Any) -> None:
        """Use new policy weights (same structure) for the next rollouts."""
        self.params = params

    def start(self, prompts: Sequence[Sequence[int]], group_size: int, key: jax.Array) -> SamplerState:
        """Prefill each prompt once and copy it to `group_size` rows (row = prompt * G + g)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        width = next_pow2(max(len(p) for p in prompts))
        arr = np.zeros((len(prompts), width), np.int32)
        for i, p in enumerate(prompts):
            arr[i, :len(p)] = p
        lengths = np.array([len(p) for p in prompts], np.int32)
        return self._prefill(self.graphdef, self.params, jnp.asarray(arr), jnp.asarray(lengths), key,
                             group_size=group_size, cache_len=width + self.config.max_new_tokens,
                             resp_len=self.config.max_new_tokens, cache_dtype=self.cache_dtype)

    def decode(self, state: SamplerState) -> SamplerState:
        """Sample until every row is done or paused at a stop string. Donates `state`."""
        return self._decode(self.graphdef, self.params, state, self.stop_table, self.eos_ids,
                            cfg=self.config, max_steps=self.max_steps)

    def insert(self, state: SamplerState, blocks: Sequence[Sequence[int]],
               end_rows: Sequence[bool] | None = None) -> SamplerState:
        """Append `blocks[b]` (may be empty) to each row and resume; `end_rows` rows end instead.
        Donates `state`."""
        b = len(blocks)
        width = next_pow2(max([len(x) for x in blocks] + [1]), minimum=8)
        ids = np.zeros((b, width), np.int32)
        n = np.zeros(b, np.int32)
        for i, blk in enumerate(blocks):
            ids[i, :len(blk)] = blk
            n[i] = len(blk)
        end = np.zeros(b, bool) if end_rows is None else np.asarray(end_rows, bool)
        return self._insert(self.graphdef, self.params, state, jnp.asarray(ids), jnp.asarray(n),
                            jnp.asarray(end))

