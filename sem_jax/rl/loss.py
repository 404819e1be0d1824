"""Chunked token log-probabilities and the GRPO loss as (sum, count) pairs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sem_jax.model.qwen2 import Qwen2

LOSS_AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "dr_grpo")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    beta: float = 0.001             # KL coefficient (k3 estimator); 0 skips the reference model
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # asymmetric upper clip (DAPO); None = clip_eps
    loss_agg: str = "seq_mean_token_mean"
    dr_grpo_length: int = 512       # constant normaliser for loss_agg="dr_grpo"

    def __post_init__(self):
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_agg={self.loss_agg!r}; choose one of {LOSS_AGGREGATIONS}")


def token_logprobs(model: Qwen2, inputs: jax.Array, targets: jax.Array, chunk: int = 128,
                   segment_ids: jax.Array | None = None, per_layer: bool = False,
                   start: jax.Array | None = None, group: int = 1, unroll_head: int = 1,
                   layers: list[dict[str, jax.Array]] | None = None,
                   residual: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """log p(target | inputs up to its position) and entropy, float32 in the shape of `targets`,
    without ever holding [B, T, V].

    Without `start`, targets are [B, T] and target t follows input position t. With `start`
    ([B] int), targets are a window [B, R], R <= T: target j of row b follows input position
    start[b] + j (start is clamped to T - R), and the LM head runs on those R positions only
    (GRPO needs no log-probs on the prompt). The head runs chunk by chunk under
    `jax.checkpoint`, so the backward pass recomputes each chunk's logits instead of storing
    them. `per_layer`: run the layers one by one on slices of the stacked weights instead of
    scanning them (faster on XLA:CPU, see `Qwen2.hidden_states`; compile time grows with depth).

    `group` (with `start`): rows come in runs of `group` that share their inputs before `start`
    (a GRPO group: one prompt, G responses; `build_batch(group_size=)` checks it). Each run's
    prefix is then computed once, into a KV cache copied to its rows, and each row runs only its
    R window positions on top of it: the same values (and gradients, summed over the run), for
    the prompt's work once per group instead of once per row, as the sampler's prefill does.

    `unroll_head`: chunks per iteration of the loop over them (the same values): XLA's cost
    analysis counts a loop's body once, so `sem_jax.aot.roofline` compiles 1 and 2.

    `layers`: the per-layer weights to run (as `per_layer`, but given: LoRA's adapted layers).
    `residual` [B, T, E]: the residual stream entering `layers[0]` at every input position (the
    layers below already run, by the sampler: `KVCache.resid`), instead of the embeddings.
    """
    if layers is None and per_layer:
        layers = model.layer_list()
    if start is None:
        if group != 1:
            raise ValueError("token_logprobs(group=...) shares the prefix before each row's window: pass start")
        hidden, _ = model.hidden_states(inputs, segment_ids=segment_ids, layers=layers, residual=residual)
    else:
        hidden = _window_hidden(model, inputs, start, targets.shape[1], group, layers, residual)
    w = model.lm_head_weight()
    b, t, e = hidden.shape
    chunk = head_chunk(t, chunk)
    h = hidden.reshape(b, t // chunk, chunk, e).swapaxes(0, 1)
    tg = targets.reshape(b, t // chunk, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one(args):
        hc, tc = args
        logits = jnp.dot(hc.reshape(-1, e), w, preferred_element_type=jnp.float32).reshape(b, chunk, -1)
        lse = jax.nn.logsumexp(logits, axis=-1)
        lp = jnp.take_along_axis(logits, tc[..., None], -1)[..., 0] - lse
        probs = jnp.exp(logits - lse[..., None])
        ent = lse - jnp.sum(probs * logits, axis=-1)
        return lp, jax.lax.stop_gradient(ent)

    _, (lp, ent) = jax.lax.scan(lambda c, x: (c, one(x)), None, (h, tg), unroll=unroll_head)
    return lp.swapaxes(0, 1).reshape(b, t), ent.swapaxes(0, 1).reshape(b, t)


def head_chunk(t: int, chunk: int) -> int:
    """Positions per chunk of the LM head over `t` positions: at most `chunk`, dividing `t`."""
    chunk = min(chunk, t)
    while t % chunk:  # bucketed lengths (2^k, 3 * 2^(k-1)) have large power-of-two divisors
        chunk //= 2
    return chunk


def _window_hidden(model: Qwen2, inputs: jax.Array, start: jax.Array, width: int, group: int,
                   layers, residual: jax.Array | None = None) -> jax.Array:
    """Hidden states [N, R] at input positions start[b] + j, j < R = `width` (from `residual`
    entering `layers[0]` when given, see `token_logprobs`)."""
    n, t = inputs.shape
    prefix = t - width  # the longest shared prefix
    start = jnp.minimum(start, prefix)  # as dynamic_slice would clamp it (and the prefix's cache must agree)
    cut = lambda x: jax.vmap(lambda row, s: jax.lax.dynamic_slice_in_dim(row, s, width))(x, start)
    if group == 1 or prefix == 0:
        hidden, _ = model.hidden_states(inputs, layers=layers, residual=residual)
        return cut(hidden)
    if n % group:
        raise ValueError(f"{n} rows do not split into groups of {group} sharing a prompt")
    first = lambda x: x.reshape(n // group, group, *x.shape[1:])[:, 0]
    cache = model.init_cache(n // group, t, per_layer=layers is not None)
    if layers is not None:  # the run of layers given (the top ones with `residual`), not the model's depth
        cache = dataclasses.replace(cache, k=cache.k[:len(layers)], v=cache.v[:len(layers)])
    pre, win = (None, None) if residual is None else (first(residual)[:, :prefix], cut(residual))
    # Slots past a row's start hold prefix padding; its window overwrites or masks them.
    _, cache = model.hidden_states(first(inputs)[:, :prefix], cache=cache, num_new=first(start), window=0,
                                   layers=layers, residual=pre)
    hidden, _ = model.hidden_states(cut(inputs), cache=cache.repeat_rows(group), window=prefix, layers=layers,
                                    residual=win)
    return hidden


def grpo_loss(logprobs: jax.Array, old_logprobs: jax.Array, ref_logprobs: jax.Array | None,
              advantages: jax.Array, mask: jax.Array, cfg: GRPOConfig) -> tuple[jax.Array, jax.Array, dict]:
    """Clipped-ratio policy gradient + beta * k3 KL. Returns (loss_sum, count, stats sums).

    loss = loss_sum / count, with sums and counts added over micro-batches first, so
    gradient accumulation gives the same result as one big batch.
    """
    adv = advantages[:, None]
    ratio = jnp.exp(logprobs - old_logprobs)
    high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    clipped = jnp.clip(ratio, 1 - cfg.clip_eps, 1 + high)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    kl = jnp.zeros_like(per_token)
    if ref_logprobs is not None and cfg.beta > 0:
        d = ref_logprobs - logprobs
        kl = jnp.exp(d) - d - 1.0
        per_token = per_token + cfg.beta * kl
    tokens = mask.sum(-1)
    if cfg.loss_agg == "seq_mean_token_mean":
        loss_sum = jnp.sum((per_token * mask).sum(-1) / jnp.maximum(tokens, 1.0))
        count = jnp.sum(tokens > 0).astype(jnp.float32)
    elif cfg.loss_agg == "token_mean":
        loss_sum, count = jnp.sum(per_token * mask), jnp.sum(mask)
    else:  # dr_grpo: a constant normaliser, independent of response lengths
        loss_sum = jnp.sum(per_token * mask)
        count = jnp.float32(mask.shape[0] * cfg.dr_grpo_length)
    was_clipped = ((ratio < 1 - cfg.clip_eps) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
    stats = {"kl": jnp.sum(kl * mask), "clip_frac": jnp.sum(was_clipped * mask), "tokens": jnp.sum(mask)}
    return loss_sum, count, stats
