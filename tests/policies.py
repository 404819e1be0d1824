"""Test policies: a random tiny Qwen2 and a scripted policy that writes a fixed text."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sem_jax.model import KVCache, Qwen2, Qwen2Config

TINY = Qwen2Config(vocab_size=211, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6,
                   num_kv_heads=2, rope_theta=1e6)


def random_qwen2(seed=0, cfg=TINY, scale=0.3):
    model = Qwen2(cfg, rngs=nnx.Rngs(seed))
    for i, var in enumerate(jax.tree.leaves(nnx.state(model), is_leaf=lambda v: isinstance(v, nnx.Variable))):
        var.set_value(var[...] + jax.random.normal(jax.random.key(seed * 1000 + i), var.shape) * scale)
    return model


class ScriptedPolicy(nnx.Module):
    """Forces a row's token at absolute position p to be `script[row, p]` (huge logit margin).

    Same interface as `Qwen2` for the sampler (config, dtype, init_cache, extend). The
    cache holds no keys; its lengths advance as the real one's do, so inserted blocks
    shift positions exactly as in the real model.
    """

    def __init__(self, script: np.ndarray, vocab_size: int):
        self.script = nnx.Variable(jnp.asarray(script, jnp.int32))  # [B, S]
        self.config = Qwen2Config(vocab_size=vocab_size, hidden_size=8, intermediate_size=8,
                                  num_layers=1, num_heads=1, num_kv_heads=1)
        self.dtype = jnp.float32

    def init_cache(self, batch, max_length, dtype=None, per_layer=False):
        z = jnp.zeros((batch, 1, max_length, 1), jnp.float32)  # [batch, kv_heads, slots, head_dim]
        if per_layer:  # one layer, keys transposed
            return KVCache(k=(jnp.swapaxes(z, 2, 3),), v=(z,), lengths=jnp.zeros((batch,), jnp.int32))
        stacked = jnp.swapaxes(z, 1, 2)[None]  # [layers, batch, slots, kv_heads, head_dim]
        return KVCache(k=stacked, v=stacked, lengths=jnp.zeros((batch,), jnp.int32))

    def layer_list(self, transposed=False):
        return [{}]

    def hidden_states(self, tokens, *, cache, num_new=None, window=None, layers=None):
        b, t = tokens.shape
        script = self.script[...]
        # A prefill (an empty cache) runs on one row per prompt: prompt i is script row i * S / b.
        # The row is kept in the cache's first value slot (the cache holds nothing else), so it
        # follows the row to its G copies and into any sub-batch the sampler gathers.
        stored = (cache.v[0][:, 0, 0, 0] if cache.per_layer else cache.v[0, :, 0, 0, 0]).astype(jnp.int32)
        rows = jnp.where(cache.lengths == 0, jnp.arange(b) * script.shape[0] // b, stored)
        pos = cache.lengths[:, None] + jnp.arange(t)[None] + 1  # the token this output predicts
        nxt = script[rows[:, None], jnp.minimum(pos, script.shape[1] - 1)]
        step = t if num_new is None else num_new
        v = ((cache.v[0].at[:, 0, 0, 0].set(rows.astype(jnp.float32)),) if cache.per_layer
             else cache.v.at[0, :, 0, 0, 0].set(rows.astype(jnp.float32)))
        return jax.nn.one_hot(nxt, self.config.vocab_size) * 100.0, \
            KVCache(k=cache.k, v=v, lengths=cache.lengths + step)

    def logits(self, hidden, keep_head_layout=False):
        return hidden

    def spreads_head(self, n):
        return False

    def extend(self, tokens, cache, num_new=None, window=None, layers=None):
        hidden, cache = self.hidden_states(tokens, cache=cache, num_new=num_new)
        return self.logits(hidden), cache


def packing_case(seed: int, count: int):
    """A small untied Qwen2 over 64 ids and `count` random supervised pairs for it: a prompt,
    a trained segment and an untrained one (an inserted result), of varied lengths."""
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=1)
    rng = np.random.RandomState(seed)
    pairs = [(list(rng.randint(2, 64, rng.randint(3, 9))), [(list(rng.randint(2, 64, rng.randint(2, 7))), True),
                                                              (list(rng.randint(2, 64, 3)), False)]) for _ in range(count)]
    return Qwen2(cfg, rngs=nnx.Rngs(0)), pairs
