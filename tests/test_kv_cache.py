"""Batched prefill of ragged prompts + decode steps == full forward at every position."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sem_jax.model import Qwen2, Qwen2Config

CFG = Qwen2Config(vocab_size=211, hidden_size=48, intermediate_size=96, num_layers=3, num_heads=6,
                  num_kv_heads=2, rope_theta=1e6)


def _random_model(seed=0):
    model = Qwen2(CFG, rngs=nnx.Rngs(seed))
    # Larger-than-init weights so that position errors show in the logits.
    for i, var in enumerate(jax.tree.leaves(nnx.state(model), is_leaf=lambda v: isinstance(v, nnx.Variable))):
        noise = jax.random.normal(jax.random.key(i), var.shape) * 0.2
        var.set_value(var[...] + noise)
    return model


@pytest.mark.parametrize("per_layer", [False, True])
def test_ragged_prefill_then_decode_matches_full_forward(per_layer):
    """Stacked layers under the scan, or each layer's weights and cache as arrays of their own."""
    model = _random_model()
    rng = np.random.RandomState(0)
    lens = np.array([5, 9, 3, 7])
    steps = 8
    seqs = [rng.randint(0, CFG.vocab_size, n + steps) for n in lens]
    prompt = np.zeros((len(lens), lens.max()), np.int32)
    for b, n in enumerate(lens):
        prompt[b, :n] = seqs[b][:n]

    extend = jax.jit(lambda m, t, c, n: m.extend(t, c, n, layers=m.layer_list() if per_layer else None))
    cache = model.init_cache(len(lens), 32, per_layer=per_layer)
    assert cache.per_layer == per_layer and cache.max_length == 32
    logits, cache = extend(model, jnp.asarray(prompt), cache, jnp.asarray(lens))
    np.testing.assert_array_equal(np.asarray(cache.lengths), lens)
    got = {b: [np.asarray(logits[b, :n])] for b, n in enumerate(lens)}
    for s in range(steps):
        tok = np.array([[seqs[b][n + s]] for b, n in enumerate(lens)], np.int32)
        logits, cache = extend(model, jnp.asarray(tok), cache, None)
        for b in range(len(lens)):
            got[b].append(np.asarray(logits[b]))
    np.testing.assert_array_equal(np.asarray(cache.lengths), lens + steps)

    worst = 0.0
    for b, seq in enumerate(seqs):
        full = np.asarray(model(jnp.asarray(seq[None])))[0]
        mine = np.concatenate(got[b])
        assert mine.shape == full.shape
        worst = max(worst, np.abs(mine - full).max())
    print(f"max |cache - full| = {worst:.3g}")
    assert worst <= 1e-4


def test_ragged_append_mid_sequence():
    """Rows append different numbers of tokens in one call (0 for some) and stay exact."""
    model = _random_model(1)
    rng = np.random.RandomState(1)
    first, extra = np.array([4, 6, 2]), np.array([3, 0, 5])
    seqs = [rng.randint(0, CFG.vocab_size, a + e + 1) for a, e in zip(first, extra)]
    cache = model.init_cache(3, 16)

    def padded(parts, width):
        out = np.zeros((len(parts), width), np.int32)
        for b, p in enumerate(parts):
            out[b, :len(p)] = p
        return jnp.asarray(out)

    _, cache = model.extend(padded([s[:a] for s, a in zip(seqs, first)], 6), cache, jnp.asarray(first))
    _, cache = model.extend(padded([s[a:a + e] for s, a, e in zip(seqs, first, extra)], 5), cache,
                            jnp.asarray(extra))
    last = np.array([[s[a + e]] for s, a, e in zip(seqs, first, extra)], np.int32)
    logits, cache = model.extend(jnp.asarray(last), cache)
    for b, seq in enumerate(seqs):
        full = np.asarray(model(jnp.asarray(seq[None])))[0, -1]
        np.testing.assert_allclose(np.asarray(logits[b, 0]), full, atol=1e-4)


def test_attention_mask_left_padding_matches_unpadded():
    model = _random_model(2)
    seq = np.random.RandomState(2).randint(0, CFG.vocab_size, 7)
    padded = np.concatenate([np.zeros(3, np.int32), seq])[None]
    mask = np.concatenate([np.zeros(3), np.ones(7)])[None].astype(np.int32)
    got = np.asarray(model(jnp.asarray(padded), attention_mask=jnp.asarray(mask)))[0, 3:]
    want = np.asarray(model(jnp.asarray(seq[None])))[0]
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_per_layer_cache_and_weights_go_together():
    model = _random_model()
    tok = jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="per-layer KV cache goes with per-layer weights"):
        model.extend(tok, model.init_cache(2, 8, per_layer=True))
    with pytest.raises(ValueError, match="need a per-layer KV cache"):
        model.extend(tok, model.init_cache(2, 8), layers=model.layer_list())
