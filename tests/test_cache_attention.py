"""The Pallas cache-attention kernel (interpreted on CPU) against a float64 numpy softmax, and the
model's decode and insert through it against XLA's attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sem_jax.model import Qwen2, Qwen2Config
from sem_jax.kernels.cache_attention import cache_attention_local, merge
from sem_jax.sharding import make_mesh


def _reference(q, kc, vc, layer, lengths, window, k_new, v_new, causal):
    """Softmax over slots < min(length, window) of the cache and this call's keys (causal)."""
    q, kc, vc, k_new, v_new = (np.asarray(a, np.float64) for a in (q, kc, vc, k_new, v_new))
    b, kv, nq, d = q.shape
    out = np.zeros(q.shape)
    for r in range(b):
        n = min(int(lengths[r]), window)
        for j in range(kv):
            keys = np.concatenate([kc[layer, r, :n, j], k_new[r, :, j]])
            vals = np.concatenate([vc[layer, r, :n, j], v_new[r, :, j]])
            s = q[r, j] @ keys.T / np.sqrt(d)  # [Q, n + T]
            s[:, n:] = np.where(causal, s[:, n:], -np.inf)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[r, j] = (p / p.sum(axis=1, keepdims=True)) @ vals
    return out


@pytest.mark.parametrize("t", [1, 3])
def test_kernel_matches_a_float64_softmax(t):
    """Rows of length 0, inside the first block, across blocks and at the window; the window not
    a multiple of the block; row groups whose blocks past their longest row are never fetched;
    query rows padded to a sublane and tiled in blocks (8 rows of 24 at T = 3); this call's own keys
    merged in (causal when T > 1), or at T = 1 taken into the kernel's softmax (`own`), which
    returns the normalised output in bfloat16."""
    rng = np.random.default_rng(t)
    layers, b, slots, d, g, window = 3, 8, 100, 128, 7, 72
    bf = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    kc, vc = bf(layers, b, slots, 1, d), bf(layers, b, slots, 1, d)
    # NaN past the window and past the cache: the kernel must never let them into a row.
    kc, vc = kc.at[:, :, window:].set(jnp.nan), vc.at[:, :, window:].set(jnp.nan)
    lengths = np.array([0, 5, 33, 72, 90, 16, 17, 1])
    q, k_new, v_new = bf(b, 1, g * t, d), bf(b, t, 1, d), bf(b, t, 1, d)
    causal = np.tile(np.tril(np.ones((t, t), bool)), (g, 1))  # query row (head, token)
    for block, query_block in ((16, 8), (24, 512), (512, 16)):
        o, m, l = jax.jit(lambda q, kc, vc, i, n: cache_attention_local(
            q, kc, vc, i, n, window, block=block, query_block=query_block, interpret=True))(
            q, kc, vc, jnp.int32(1), jnp.asarray(lengths))
        own = jnp.einsum("bkqd,btkd->bkqt", q, k_new, preferred_element_type=jnp.float32) * d ** -0.5
        got = merge(o, m, l, jnp.where(causal, own, -1e30), v_new)
        want = _reference(q, kc, vc, 1, lengths, window, k_new, v_new, causal)
        assert np.isfinite(np.asarray(got)).all()
        # p is rounded to bfloat16 before the value dot, as in XLA's path
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-2, rtol=0)
        assert np.abs(np.asarray(got) - want).mean() < 2e-3
        if t == 1:
            own = tuple(jnp.moveaxis(a, 1, 2) for a in (k_new, v_new))  # [B, K, 1, D]
            out = jax.jit(lambda q, kc, vc, i, n, own: cache_attention_local(
                q, kc, vc, i, n, window, own, block=block, query_block=query_block, interpret=True))(
                q, kc, vc, jnp.int32(1), jnp.asarray(lengths), own)
            assert out.dtype == jnp.bfloat16 and out.shape == q.shape
            out = np.asarray(out, np.float32)
            np.testing.assert_allclose(out, want, atol=2e-2, rtol=0)
            assert np.abs(out - want).mean() < 2e-3


CFG = Qwen2Config(vocab_size=211, hidden_size=48, intermediate_size=96, num_layers=3, num_heads=6,
                  num_kv_heads=2, rope_theta=1e6)


def test_model_decode_and_insert_through_the_kernel_match_xla():
    """Prefill, an insert of several tokens and decode steps with the cache read by the kernel
    (interpreted; 2 KV heads over tensor 2, rows over data 4) give XLA's logits."""
    rng = np.random.RandomState(0)
    lens = np.array([5, 9, 3, 7, 1, 4, 8, 6])
    models = {mode: Qwen2(CFG, rngs=nnx.Rngs(0), cache_kernel=mode) for mode in ("interpret", "xla")}
    mesh = make_mesh(data=4, fsdp=1, tensor=2)
    prompt = jnp.asarray(rng.randint(0, CFG.vocab_size, (8, 9)), jnp.int32)
    insert = jnp.asarray(rng.randint(0, CFG.vocab_size, (8, 4)), jnp.int32)
    steps = [jnp.asarray(rng.randint(0, CFG.vocab_size, (8, 1)), jnp.int32) for _ in range(5)]
    got = {}
    with jax.set_mesh(mesh):
        for mode, model in models.items():
            extend = jax.jit(lambda t, c, n, window: model.extend(t, c, n, window=window), static_argnums=3)
            cache = model.init_cache(8, 40)
            out = []
            logits, cache = extend(prompt, cache, jnp.asarray(lens), 0)
            logits, cache = extend(insert, cache, jnp.asarray([4, 0, 2, 4, 1, 3, 4, 2]), 16)
            out.append(logits)
            for tokens in steps:
                logits, cache = extend(tokens, cache, None, 24)
                out.append(logits)
            got[mode] = np.concatenate([np.asarray(x).reshape(8, -1) for x in out], axis=1)
    np.testing.assert_allclose(got["interpret"], got["xla"], atol=1e-4)


def test_kernel_mode_that_cannot_apply_names_why():
    model = Qwen2(CFG, rngs=nnx.Rngs(0), cache_kernel="pallas")
    with pytest.raises(ValueError, match="one KV head per device"):
        model.extend(jnp.zeros((2, 1), jnp.int32), model.init_cache(2, 8), window=8)
    with pytest.raises(ValueError, match="cache_kernel="):
        Qwen2(CFG, rngs=nnx.Rngs(0), cache_kernel="mosaic")

