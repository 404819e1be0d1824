"""The splash kernels of `flash_attention`, interpreted on the CPU, against float64 numpy and
against XLA's `attention` (values and gradients), alone and in the model under a mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sem_jax.model import Qwen2, Qwen2Config
from sem_jax.kernels.flash_attention import block, flash_attention, kernel_cost
from sem_jax.model.qwen2 import attention
from sem_jax.sharding import make_mesh


def reference(q, k, v, ids):
    """Causal grouped-query attention in float64; ids [B, T] (a token sees keys of its own id)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, d = q.shape
    g = h // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d)
    mask = np.tril(np.ones((t, t), bool))[None] & (ids[:, :, None] == ids[:, None, :])
    scores = np.where(mask[:, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), v)


def _qkv(b, t, h, kv, d, seed=0):
    r = np.random.default_rng(seed)
    return tuple(jnp.asarray(r.normal(size=s), jnp.float32) for s in ((b, t, h, d), (b, t, kv, d), (b, t, kv, d)))


@pytest.mark.parametrize("t", [128, 384, 512])
@pytest.mark.parametrize("ids", ["none", "padding", "packed"])
def test_kernel_matches_float64_causal_attention(t, ids):
    """Blocks of 128 (3 of them at 384: the ones above the diagonal skipped) and of 512; no ids,
    a padded row's 0/1 mask (right and left padding), packed runs."""
    b, h, kv, d = 2, 4, 2, 128
    q, k, v = _qkv(b, t, h, kv, d)
    seg = np.ones((b, t), np.int32)
    if ids == "padding":
        seg[0, t - 40:] = 0
        seg[1, :33] = 0
    elif ids == "packed":
        seg[:, :] = np.repeat(np.arange(1, 5), t // 4)[None]
        seg[1, 70:] += 1
    got = flash_attention(q, k, v, None if ids == "none" else jnp.asarray(seg), interpret=True)
    want = reference(q, k, v, seg)
    real = seg > 0 if ids == "padding" else np.ones((b, t), bool)  # a padded row's pads attend to pads
    np.testing.assert_allclose(np.asarray(got)[real], want[real], atol=2e-5, rtol=0)


def test_kernel_gradients_match_xla_attention():
    """The backward kernels (dq, dkv) give XLA's gradients for a padded batch, the loss on its
    real tokens."""
    b, t, h, kv, d = 2, 384, 4, 2, 128
    q, k, v = _qkv(b, t, h, kv, d, seed=1)
    am = np.ones((b, t), np.int32)
    am[0, 300:] = 0
    am[1, :50] = 0
    mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None] & am[:, None, :].astype(bool))
    w = jnp.asarray(np.random.default_rng(2).normal(size=(b, t, h, d)) * am[:, :, None, None], jnp.float32)
    kernel = jax.grad(lambda *a: (flash_attention(*a, jnp.asarray(am), interpret=True) * w).sum(), argnums=(0, 1, 2))
    xla = jax.grad(lambda *a: (attention(*a, mask) * w).sum(), argnums=(0, 1, 2))
    for name, got, want in zip("qkv", kernel(q, k, v), xla(q, k, v)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0, err_msg=f"d{name}")


CFG = Qwen2Config(vocab_size=211, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=128, rope_theta=1e6)


def test_model_forward_gradient_and_prefill_through_the_kernels_match_xla():
    """The training forward (with an attention mask and with packed rows), its parameter
    gradients and a prefill, with the kernels interpreted (rows over data 4, heads over tensor 2),
    give XLA's on every real token."""
    rng = np.random.RandomState(0)
    b, t = 8, 256
    tokens = jnp.asarray(rng.randint(0, CFG.vocab_size, (b, t)), jnp.int32)
    am = np.ones((b, t), np.int32)
    am[::2, 200:] = 0
    am[1::4, :17] = 0
    packed = np.repeat(np.arange(1, 5), t // 4)[None].repeat(b, 0)
    weight = jnp.asarray(am[:, :, None], jnp.float32)
    got = {}
    with jax.set_mesh(make_mesh(data=4, fsdp=1, tensor=2)):
        for mode in ("interpret", "xla"):
            model = Qwen2(CFG, rngs=nnx.Rngs(0), attention_kernel=mode)
            graph, params = nnx.split(model)

            def loss(p, **kw):
                h, _ = nnx.merge(graph, p).hidden_states(tokens, **kw)
                return (h * weight).sum(), h

            grads, hidden = jax.jit(jax.grad(lambda p: loss(p, attention_mask=jnp.asarray(am)), has_aux=True))(params)
            packed_h = jax.jit(lambda p: loss(p, segment_ids=jnp.asarray(packed))[1])(params)
            prefill = jax.jit(lambda t: model.extend(t, model.init_cache(b, t.shape[1] + 8), window=0)[0])(tokens)
            got[mode] = (hidden, grads, packed_h, prefill)
    real = am.astype(bool)
    np.testing.assert_allclose(np.asarray(got["interpret"][0])[real], np.asarray(got["xla"][0])[real], atol=1e-4)
    for path, g in jax.tree_util.tree_leaves_with_path(got["interpret"][1]):
        want = dict(jax.tree_util.tree_leaves_with_path(got["xla"][1]))[path]
        scale = np.abs(np.asarray(want)).max()  # sums over 16k positions: float32 rounding scales with them
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), atol=1e-5 * scale, rtol=0, err_msg=str(path))
    for i in (2, 3):
        np.testing.assert_allclose(np.asarray(got["interpret"][i]), np.asarray(got["xla"][i]), atol=1e-4)


def test_kernel_mode_that_cannot_apply_names_why():
    model = Qwen2(CFG, rngs=nnx.Rngs(0), attention_kernel="pallas")
    with pytest.raises(ValueError, match=r"attention_kernel='pallas' needs whole blocks of 128 tokens \(have 100\)"):
        model(jnp.zeros((2, 100), jnp.int32))
    with pytest.raises(ValueError, match="attention_kernel="):
        Qwen2(CFG, rngs=nnx.Rngs(0), attention_kernel="splash")


def test_kernel_cost_by_hand():
    """One head, 1024 tokens in blocks of 512: 3 of the 4 blocks computed, each a [512, 128] x
    [128, 512] matmul (2 * 512 * 512 * 128 FLOPs) twice in the forward, 3 times in dq, 4 in dkv;
    the forward reads q (256 KiB in bf16), writes o and the f32 logsumexp (4 KiB) and per block
    fetches a key and a value block (128 KiB each)."""
    assert block(1024) == 512 and block(384) == 128 and block(100) is None
    dot = 2 * 512 * 512 * 128
    flops, nbytes = kernel_cost("fwd", 1, 1024, 128, 2)
    assert flops == 3 * 2 * dot
    assert nbytes == 2 * 262144 + 4096 + 3 * 2 * 131072
    assert kernel_cost("dq", 1, 1024, 128, 2)[0] == 3 * 3 * dot
    assert kernel_cost("dkv", 1, 1024, 128, 2)[0] == 3 * 4 * dot


def test_config_kernels_reach_the_model(tmp_path):
    """`model.kernels` sets both kernel modes of the model the trainer builds (random init; a
    checkpoint through `from_pretrained(kernels=)`) and of the AOT check's; a mode that does not
    exist is refused by name."""
    from conftest import write_hf_qwen2

    from sem_jax.assemble import abstract_model
    from sem_jax.assemble import build_policy
    from sem_jax.config import cpu_config
    from sem_jax.config import load
    from sem_jax.model import from_pretrained

    config = load(cpu_config()).replace(**{"model.kernels": "xla"})
    model, _ = build_policy(config, lambda: ["a b c d"] * 50, str(tmp_path))
    write_hf_qwen2(tmp_path / "hf", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1)
    loaded = from_pretrained(str(tmp_path / "hf"), kernels="xla")
    abstract = abstract_model(config, CFG, make_mesh(), "float32")[0]
    assert {(m.cache_kernel, m.attention_kernel) for m in (model, loaded, abstract)} == {("xla", "xla")}
    with pytest.raises(ValueError, match="config.model.kernels='mosaic': choose one of auto, xla, pallas, interpret"):
        config.replace(**{"model.kernels": "mosaic"})
    with pytest.raises(ValueError, match="cache_kernel='mosaic'"):
        Qwen2(CFG, rngs=nnx.Rngs(0), cache_kernel="mosaic")
