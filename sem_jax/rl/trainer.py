"""The jitted GRPO update: micro-batched gradients, AdamW, global-norm clipping, and a
non-finite guard that skips (and counts) a bad step instead of applying it. The same update
with a supervised objective is the format warm start (`sem_jax.sft`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sem_jax.kernels.dispatch import per_layer_default
from sem_jax.model import lora as lora_lib
from sem_jax.rl.loss import GRPOConfig, grpo_loss, token_logprobs
from sem_jax.sharding import put, replicated

# What `token_logprobs` reads from a batch; "start" (a response window per row, `build_batch`),
# "segment_ids" (packed supervised rows, `sft.pack`) and "resid" (the residual stream the sampler
# kept at the lowest adapted layer: a LoRA trainer starts there) are optional.
LOGPROB_KEYS = ("inputs", "targets", "start", "segment_ids", "resid")
OBJECTIVES = ("grpo", "nll")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0          # global norm; 0: no clipping
    warmup_steps: int = 0
    schedule: str = "constant"  # or "cosine" (to 0 at total_steps)
    total_steps: int = 1000


def learning_rate(cfg: OptimConfig) -> optax.Schedule:
    """The learning rate by update count: linear warmup from 0 (when `warmup_steps`), then
    constant or a cosine decay to 0 at `total_steps`."""
    warm = max(cfg.warmup_steps, 0)
    if cfg.schedule == "constant":
        return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warm), optax.constant_schedule(cfg.lr)],
                                    [warm]) if warm else optax.constant_schedule(cfg.lr)
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0 if warm else cfg.lr, cfg.lr, warm,
                                                  max(cfg.total_steps, warm + 1))
    raise ValueError(f"schedule={cfg.schedule!r}; choose constant or cosine")


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(learning_rate(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip else adamw


def _micro(batch: dict[str, jax.Array], size: int, unit: int = 1) -> dict[str, jax.Array]:
    """[N, ...] -> [N / size, size, ...], micro-batch j holding runs j, j + N/size, ... of `unit`
    consecutive rows (rows j, j + N/size, ... for unit 1): rows are sharded in contiguous blocks
    over the batch axes (one per device, one range per process), so strided micro-batches keep
    every device busy in each of them; runs (rows sharing a prompt) stay whole."""
    def split(v):
        n = v.shape[0]
        v = v.reshape(size // unit, n // size, unit, *v.shape[1:]).swapaxes(0, 1)
        return v.reshape(n // size, size, *v.shape[3:])
    return {k: split(v) for k, v in batch.items()}


def _unmicro(x: jax.Array, unit: int = 1) -> jax.Array:
    """The inverse of `_micro` for one array: [N / size, size, ...] -> [N, ...]."""
    m, size = x.shape[:2]
    x = x.reshape(m, size // unit, unit, *x.shape[2:]).swapaxes(0, 1)
    return x.reshape(m * size, *x.shape[3:])


class Trainer:
    """Holds the jitted logprob and update functions for one model graph.

    `per_layer` (default: `per_layer_default()`) runs the layers one by one instead of under the
    layer scan (`token_logprobs`); pass False to compile for another backend from a CPU host.

    `group_size`: batches hold groups of this many consecutive rows with one prompt (the
    rollout's G; `build_batch(group_size=)` checks it). Runs of `share` rows then compute their
    prompt once (`token_logprobs(group=)`), `share` being the largest divisor of G that also
    divides the rows each of the `shards` batch shards holds in a micro-batch (a run never spans
    devices); the row count of a batch must be a multiple of `share` on every process.

    `objective="nll"`: the mean negative log-likelihood of the masked targets instead of GRPO's
    loss (no advantages, old or sampler log-probs), with the same micro-batching, optimizer and
    guard: the supervised warm start (`sem_jax.sft`), on the same meshes as training.

    `lora`: the trained parameters are the adapters (`sem_jax.model.lora`), the base weights a
    frozen argument of `update` (`base=`), never donated or updated. With per-layer weights the
    layers below the lowest adapted one are built from the base alone, so the backward pass
    stops there; under the layer scan the adapters are merged into the stacked kernels (exact
    gradients, the backward through every layer). A batch with "resid" (the residual stream
    entering the lowest adapted layer, as the sampler computed it) runs only the layers from
    there, for the update and the reference pass alike: the frozen layers are not run again.
    """

    def __init__(self, model: Any, grpo: GRPOConfig, optim: OptimConfig, *, micro_batch: int,
                 logprob_chunk: int = 128, per_layer: bool | None = None, group_size: int = 1, shards: int = 1,
                 objective: str = "grpo", unroll_head: int = 1, lora: lora_lib.LoraSpec | None = None):
        if objective not in OBJECTIVES:
            raise ValueError(f"objective={objective!r}; choose one of {OBJECTIVES}")
        self.objective = objective
        self.lora = lora
        self.unroll_head = unroll_head  # see token_logprobs: for XLA's cost analysis only
        self.graphdef, _ = nnx.split(model)
        self.grpo, self.optim, self.micro_batch, self.chunk = grpo, optim, micro_batch, logprob_chunk
        self.share = math.gcd(micro_batch // shards, group_size) if micro_batch % shards == 0 else 1
        self.per_layer = per_layer_default() if per_layer is None else per_layer
        self.tx = make_optimizer(optim)
        self.ref_passes = 0  # reference forward passes run (0 when beta == 0)
        # The compiled functions (`sem_jax.aot` lowers these for a target without running them).
        self.logprobs_fn = jax.jit(self._logprobs)
        self.update_fn = jax.jit(self._update, donate_argnums=(0, 1))

    def init_opt_state(self, params):
        """Optimizer state placed as `update` returns it: optax makes the step count an
        uncommitted scalar, and a committed one at step 2 would compile the update again."""
        state = self.tx.init(params)
        whole = replicated(jax.tree.leaves(params)[0].sharding)
        return jax.tree.map(lambda x: x if getattr(x, "committed", True) else put(x, whole), state)

    # -- pure functions -----------------------------------------------------------------

    def _logprobs(self, params, batch):
        def one(mb):
            return self._token_logprobs(params, None, mb)[0]
        mbs = _micro({k: batch[k] for k in LOGPROB_KEYS if k in batch}, self.micro_batch, self.share)
        return _unmicro(jax.lax.map(one, mbs), self.share)

    def _token_logprobs(self, params, adapters, mb):
        """Log-probs under `params` (a whole parameter state), plus `adapters` when given."""
        layers = None
        if adapters is not None and not self.per_layer:
            params = lora_lib.merge(self.lora, params, adapters)
        model = nnx.merge(self.graphdef, params)
        residual = None
        if self.per_layer:
            layers = model.layer_list()
            if adapters is not None:
                layers = lora_lib.layer_weights(self.lora, layers, adapters)
            if self.lora is not None and "resid" in mb:  # the layers below ran in the sampler
                layers, residual = layers[self.lora.first:], mb["resid"]
        start = mb.get("start")
        return token_logprobs(model, mb["inputs"], mb["targets"], self.chunk, segment_ids=mb.get("segment_ids"),
                              layers=layers, start=start, group=1 if start is None else self.share,
                              unroll_head=self.unroll_head, residual=residual)

    def _update(self, params, opt_state, batch, ref_logprobs, base=None):
        def loss_fn(p, mb):
            lp, ent = self._token_logprobs(p, None, mb) if self.lora is None else self._token_logprobs(base, p, mb)
            m = mb["mask"]
            if self.objective == "nll":  # token mean over the whole batch, as one big batch would give
                zero = jnp.float32(0)
                stats = dict(kl=zero, clip_frac=zero, tokens=jnp.sum(m), entropy=jnp.sum(ent * m), sampler_gap=zero)
                return -jnp.sum(lp * m), (jnp.sum(m), stats)
            old = mb["old_logprobs"] if "old_logprobs" in mb else jax.lax.stop_gradient(lp)
            loss_sum, count, stats = grpo_loss(lp, old, mb.get("ref_logprobs"), mb["advantages"], mb["mask"],
                                               self.grpo)
            stats = dict(stats, entropy=jnp.sum(ent * m),
                         sampler_gap=jnp.sum(jnp.abs(jax.lax.stop_gradient(lp) - mb["sampler_logprobs"]) * m))
            return loss_sum, (count, stats)

        data = dict(batch)
        if ref_logprobs is not None:
            data["ref_logprobs"] = ref_logprobs
        mbs = _micro(data, self.micro_batch, self.share)
        zeros = jax.tree.map(jnp.zeros_like, params)

        def body(carry, mb):
            gsum, lsum, csum, ssum = carry
            (l, (c, s)), g = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
            return (jax.tree.map(jnp.add, gsum, g), lsum + l, csum + c,
                    jax.tree.map(jnp.add, ssum, s)), None

        stat0 = {k: jnp.float32(0) for k in ("kl", "clip_frac", "tokens", "entropy", "sampler_gap")}
        (gsum, lsum, count, stats), _ = jax.lax.scan(body, (zeros, jnp.float32(0), jnp.float32(0), stat0), mbs)
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / count, gsum)
        loss = lsum / count
        grad_norm = optax.tree.norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt = self.tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jax.lax.cond(ok, lambda: (new_params, new_opt), lambda: (params, opt_state))
        tokens = jnp.maximum(stats["tokens"], 1.0)
        metrics = {"loss": loss, "grad_norm": grad_norm, "skipped": (~ok).astype(jnp.int32),
                   "kl": stats["kl"] / tokens, "clip_frac": stats["clip_frac"] / tokens,
                   "entropy": stats["entropy"] / tokens, "sampler_gap": stats["sampler_gap"] / tokens}
        return params, opt_state, metrics

    # -- host API -----------------------------------------------------------------------

    def logprobs(self, params, batch: dict[str, np.ndarray]) -> jax.Array:
        """Per-target log-probs, shaped like `batch["targets"]` (for the reference policy, or old logprobs)."""
        return self.logprobs_fn(params, {k: batch[k] for k in LOGPROB_KEYS if k in batch})

    def reference_logprobs(self, ref_params, batch):
        """None when beta == 0: the reference pass is then never run."""
        if self.grpo.beta == 0 or ref_params is None:
            return None
        self.ref_passes += 1
        return self.logprobs(ref_params, batch)

    def update(self, params, opt_state, batch: dict[str, Any], ref_logprobs=None, base=None):
        """One optimizer step over all micro-batches. Donates params and opt_state. With `lora`,
        `params` are the adapters and `base` the frozen weights they adapt."""
        if (self.lora is None) != (base is None):
            raise ValueError("a LoRA trainer updates adapters on a base (base=...); a full fine-tune takes no base")
        keys = (*LOGPROB_KEYS, "mask", "advantages", "sampler_logprobs", "old_logprobs")  # those it has
        return self.update_fn(params, opt_state, {k: batch[k] for k in keys if k in batch}, ref_logprobs, base)
