"""A decode step's fused kernels (interpreted on CPU): the MLP against a numpy MLP rounded as XLA's
three dots round it, the attention inputs against the model's XLA path, and the model's decode
through them against XLA's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from policies import random_qwen2

from sem_jax.model import Qwen2Config
from sem_jax.kernels.qkv import fused_qkv
from sem_jax.model.qwen2 import _dense, apply_rope, rms_norm, rms_scale, rope_tables
from sem_jax.kernels.spread_mlp import fits, fused_mlp, normed
from sem_jax.kernels.tpu_layout import lanes_swapped
from sem_jax.sharding import make_mesh, shard_params, tensor_groups


EPS = 1e-6


def _round(x: np.ndarray, dtype) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32).astype(dtype).astype(jnp.float32))


def _reference(x, w, gate, up, down, dtype) -> np.ndarray:
    """silu(h @ gate) * (h @ up) @ down for h = rms_norm(x, w) in float64, rounded to `dtype`
    where the XLA path rounds: the normed rows, before and after the weight, the gate's and up's
    outputs, the activation, the output."""
    x, w, gate, up, down = (np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64) for a in (x, w, gate, up, down))
    h = _round(w * _round(x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS), dtype), dtype)
    g, u = _round(h @ gate, dtype), _round(h @ up, dtype)
    act = _round(g / (1 + np.exp(-g)) * u, dtype)
    return _round(act @ down, dtype)


@pytest.mark.parametrize("m", [96, 256])  # 96: stored transposed on a TPU, read so
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fused_mlp_matches_the_three_dots(m, dtype):
    """Rows [16, 384] (the embedding in 3 blocks, the output in 3), one layer of a stack of 3 read
    by its index and the same layer given alone."""
    assert lanes_swapped((384, m)) == (m == 96)
    rng = np.random.RandomState(0)
    n, e, layers = 16, 384, 3
    x = jnp.asarray(rng.randn(n, e) * 3, dtype)
    w = jnp.asarray(1 + rng.randn(1, e) * 0.3, dtype)
    scale = rms_scale(x, EPS)
    np.testing.assert_array_equal(normed(x, scale, w), rms_norm(x, w[0], EPS))  # the model's norm
    gate, up = (jnp.asarray(rng.randn(layers, e, m) / np.sqrt(e), dtype) for _ in range(2))
    down = jnp.asarray(rng.randn(layers, m, e) / np.sqrt(m), dtype)
    want = _reference(x, w, gate[2], up[2], down[2], dtype)
    stacked = fused_mlp(x, scale, w, gate, up, down, jnp.int32(2), interpret=True)
    alone = fused_mlp(x, scale, w, gate[2], up[2], down[2], interpret=True)
    assert stacked.dtype == dtype and stacked.shape == (n, e)
    np.testing.assert_array_equal(np.asarray(stacked, np.float32), np.asarray(alone, np.float32))
    got = np.asarray(stacked, np.float32)
    ulp = 2.0 ** -7 if dtype == jnp.bfloat16 else 1e-6  # one rounding apart at most
    np.testing.assert_allclose(got, want, rtol=ulp, atol=ulp)
    # The layer read is the one asked for.
    other = _reference(x, w, gate[1], up[1], down[1], dtype)
    assert np.abs(got - other).mean() > 10 * np.abs(got - want).mean()


@pytest.mark.parametrize("qk_norm", [False, True], ids=["qwen2", "qwen3"])
@pytest.mark.parametrize("hq,hk", [(7, 1), (2, 2), (8, 4)])  # heads stored before the embedding or after
def test_fused_qkv_matches_the_model(hq, hk, qk_norm):
    """Rows [16, 384] (the embedding in 3 blocks), layer 1 of 3 stacked kernels: the norm, the
    projections, their biases (Qwen2) or zeros and each head's norm (Qwen3), and the rotary
    embedding as the model computes them in bfloat16."""
    rng = np.random.RandomState(1)
    n, e, d, layers = 16, 384, 128, 3
    bf = lambda *shape, s=1.0: jnp.asarray(rng.randn(*shape) * s, jnp.bfloat16)
    x, nw = bf(n, e, s=3.0), jnp.asarray(1 + rng.randn(e) * 0.3, jnp.bfloat16)
    wq, wk, wv = bf(layers, e, hq, d, s=e ** -0.5), bf(layers, e, hk, d, s=e ** -0.5), bf(layers, e, hk, d, s=e ** -0.5)
    bq, bk, bv = bf(hq, d), bf(hk, d), bf(hk, d)
    qn, kn = (jnp.asarray(1 + rng.randn(d) * 0.3, jnp.bfloat16) for _ in range(2))
    if qk_norm:
        bq, bk, bv = (jnp.zeros_like(b) for b in (bq, bk, bv))
    cos, sin = rope_tables(jnp.asarray(rng.randint(0, 4000, (n, 1))), d, 1e6)  # [N, 1, D]
    # Without XLA:CPU's excess precision, which drops the interpreted kernel's float32 -> bfloat16
    # -> float32 round trips (before the norm's mean: a third of Qwen3's q one ulp off); Mosaic
    # rounds as written.
    kernel = jax.jit(lambda x: fused_qkv(x, rms_scale(x, EPS), nw[None], wq, wk, wv, bq, bk, bv, cos[:, 0], sin[:, 0],
                                         jnp.int32(1), qk_norm=(qn, kn, EPS) if qk_norm else None, interpret=True),
                     compiler_options={"xla_allow_excess_precision": False})
    q, k, v = kernel(x)
    h = rms_norm(x, nw, EPS)
    proj = lambda w, b: (_dense(h, {"w": w[1]}, "w").reshape(n, 1, -1, d) + b)
    norm = (lambda y, w: rms_norm(y, w, EPS)) if qk_norm else (lambda y, w: y)
    want = (apply_rope(norm(proj(wq, bq), qn), cos, sin), apply_rope(norm(proj(wk, bk), kn), cos, sin), proj(wv, bv))
    for got, ref in zip((q, k, v), want):
        assert got.dtype == jnp.bfloat16 and got.shape == ref.shape[:1] + ref.shape[2:]
        got, ref = np.asarray(got, np.float32), np.asarray(ref[:, 0], np.float32)
        np.testing.assert_allclose(got, ref, rtol=2 ** -7, atol=2 ** -7)  # float32 sums in another order
        assert np.mean(got != ref) < 0.05  # mostly the same bfloat16


def test_fused_mlp_refuses_what_does_not_fit_vmem():
    assert fits(320, 3584, 1184, 2)  # a 7B decode step's rows and a v4 device's slice
    assert not fits(4096, 3584, 1184, 2)
    with pytest.raises(ValueError, match="do not fit VMEM"):
        fused_mlp(jnp.zeros((4096, 512)), jnp.ones((4096, 1)), jnp.ones((1, 512)), jnp.zeros((512, 2048)),
                  jnp.zeros((512, 2048)), jnp.zeros((2048, 512)))


CFG = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=1024, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=128, rope_theta=1e6)


def _decode(model, mesh, steps: int = 3) -> np.ndarray:
    """Logits of a prefill and `steps` decode steps of 8 rows on `mesh` (stacked cache)."""
    graphdef, params = nnx.split(model)
    step = jax.jit(lambda p, tokens, cache: nnx.merge(graphdef, p).extend(tokens, cache, window=16))
    out = []
    with jax.set_mesh(mesh):
        placed = shard_params(params, mesh)
        cache = jax.jit(lambda p: nnx.merge(graphdef, p).init_cache(8, 16))(placed)
        prefill = jax.jit(lambda p, tokens, cache: nnx.merge(graphdef, p).extend(tokens, cache, window=0))
        logits, cache = prefill(placed, jnp.arange(8 * 5).reshape(8, 5) % 256, cache)
        for i in range(steps):
            tokens = jnp.argmax(logits[:, -1], -1)[:, None].astype(jnp.int32)
            logits, cache = step(placed, tokens, cache)
            out.append(np.asarray(logits[:, -1]))
    return np.stack(out)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_decode_through_the_kernels_matches_xla(model_type):
    """Decode steps on the spread mesh (8 devices: 4 groups of 2, the MLP split over all 8): each
    layer's attention inputs (`fused_qkv`) and MLP (`fused_mlp`) in the kernels, on the stacked
    weights by the layer's index, give XLA's logits, also XLA's on the training mesh."""
    model = random_qwen2(0, dataclasses.replace(CFG, model_type=model_type))
    assert ("q_norm" in model.layers) == (model_type == "qwen3") != ("q_bias" in model.layers)
    mesh = tensor_groups(make_mesh(data=1, fsdp=-1, tensor=1), 2, spread=True)
    got = {}
    for mode in ("interpret", "xla"):
        model.decode_kernel = mode
        got[mode] = _decode(model, mesh)
    model.decode_kernel = "xla"
    got["flat"] = _decode(model, make_mesh(data=1, fsdp=-1, tensor=1))  # no spread: no gathered rows
    for want in (got["xla"], got["flat"]):  # float32 sums in another order: logits of about 10 within 2e-4
        np.testing.assert_allclose(got["interpret"], want, atol=2e-4, rtol=0)
        assert np.abs(got["interpret"] - want).mean() < 2e-5


def test_decode_kernels_that_cannot_apply_name_why():
    """Asked for where it cannot apply (the sampler's transposed per-layer weights), the kernel is
    refused by name; a mode that does not exist too."""
    model = random_qwen2(0, CFG)
    model.decode_kernel = "pallas"
    mesh = tensor_groups(make_mesh(data=1, fsdp=-1, tensor=1), 2, spread=True)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="decode_kernel='pallas' needs the stacked untransposed weights"):
        model.extend(jnp.zeros((8, 1), jnp.int32), model.init_cache(8, 8, per_layer=True), window=4,
                     layers=model.layer_list(transposed=True))
    with pytest.raises(ValueError, match="decode_kernel="):
        type(model)(CFG, rngs=nnx.Rngs(0), decode_kernel="mosaic")
