"""GRPO: advantages, chunked logprobs, loss and gradients against numpy; the jitted update."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from policies import random_qwen2

from sem_jax.rl.advantages import group_advantages, tied_groups
from sem_jax.rl.batch import build_batch
from sem_jax.rl.loss import GRPOConfig, grpo_loss, token_logprobs
from sem_jax.rl.trainer import OptimConfig, Trainer
from sem_jax.sampling.rollout import Trajectory


def test_group_advantages():
    r = np.array([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(r, 4)
    g = r[:4]
    np.testing.assert_allclose(adv[:4], (g - g.mean()) / (g.std() + 1e-6), rtol=1e-6)
    np.testing.assert_allclose(adv[4:], 0.0)  # identical rewards: no signal
    np.testing.assert_allclose(group_advantages(r, 4, scale_by_std=False)[:4], g - g.mean())
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(r, 3)
    assert tied_groups(r, 4) == 1 and tied_groups(r, 2) == 3 and tied_groups(np.zeros(6), 3) == 2


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_chunked_logprobs_equal_full_log_softmax():
    model = random_qwen2(0)
    rng = np.random.RandomState(0)
    inputs = rng.randint(0, 211, (3, 16))
    targets = rng.randint(0, 211, (3, 16))
    lp, ent = token_logprobs(model, jnp.asarray(inputs), jnp.asarray(targets), chunk=4)
    full = _np_log_softmax(np.asarray(model(jnp.asarray(inputs)), np.float64))
    want = np.take_along_axis(full, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(lp), want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), -(np.exp(full) * full).sum(-1), atol=1e-4)


def test_per_layer_logprobs_and_gradients_equal_the_scanned_ones():
    """The CPU trainer's default (layers one by one on slices of the stacked weights)."""
    model = random_qwen2(1)
    graph, params = nnx.split(model)
    rng = np.random.RandomState(1)
    inputs, targets = (jnp.asarray(rng.randint(0, 211, (2, 12))) for _ in range(2))
    weights = jnp.asarray(rng.randn(2, 12), jnp.float32)

    def loss(p, per_layer):
        lp, _ = token_logprobs(nnx.merge(graph, p), inputs, targets, chunk=4, per_layer=per_layer)
        return jnp.sum(lp * weights)

    (l0, g0), (l1, g1) = (jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, pl) for pl in (False, True))
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-4)


def _np_loss_and_grad(lp, old, ref, adv, mask, cfg):
    """Plain numpy: loss and d loss / d lp."""
    a = adv[:, None]
    r = np.exp(lp - old)
    hi = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    c = np.clip(r, 1 - cfg.clip_eps, 1 + hi)
    unclipped_is_min = r * a <= c * a
    per = -np.minimum(r * a, c * a)
    g = np.where(unclipped_is_min, -a * r, 0.0)
    if cfg.beta:
        d = ref - lp
        per = per + cfg.beta * (np.exp(d) - d - 1)
        g = g + cfg.beta * (1 - np.exp(d))
    n = mask.sum(-1)
    if cfg.loss_agg == "seq_mean_token_mean":
        w = mask / np.maximum(n, 1)[:, None] / (n > 0).sum()
    elif cfg.loss_agg == "token_mean":
        w = mask / mask.sum()
    else:
        w = mask / (mask.shape[0] * cfg.dr_grpo_length)
    return (per * w).sum(), g * w


@pytest.mark.parametrize("agg", ["seq_mean_token_mean", "token_mean", "dr_grpo"])
@pytest.mark.parametrize("beta,high", [(0.0, None), (0.04, None), (0.04, 0.28)])
def test_grpo_loss_and_gradient_match_numpy(agg, beta, high):
    rng = np.random.RandomState(1)
    shape = (4, 9)
    lp = rng.randn(*shape) * 0.5 - 2
    old = lp + rng.randn(*shape) * 0.4   # ratios well outside [0.8, 1.2]: clipping active
    ref = lp + rng.randn(*shape) * 0.3
    adv = np.array([1.5, -0.7, 0.0, -2.0])
    mask = (rng.rand(*shape) > 0.3).astype(np.float64)
    mask[2] = 0.0  # an empty row
    cfg = GRPOConfig(beta=beta, clip_eps=0.2, clip_eps_high=high, loss_agg=agg, dr_grpo_length=12)

    def loss(lp_):
        s, c, _ = grpo_loss(lp_, jnp.asarray(old, jnp.float32), jnp.asarray(ref, jnp.float32),
                            jnp.asarray(adv, jnp.float32), jnp.asarray(mask, jnp.float32), cfg)
        return s / c

    val, grad = jax.value_and_grad(loss)(jnp.asarray(lp, jnp.float32))
    want_val, want_grad = _np_loss_and_grad(lp, old, ref, adv, mask, cfg)
    np.testing.assert_allclose(float(val), want_val, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-6)
    assert (np.asarray(grad)[mask == 0] == 0).all()


def test_the_widest_batch_is_what_build_batch_makes_at_the_caps():
    """Compile-only checks size the update for `widest_batch`: the batch of the longest prompt and
    response the caps allow, as `build_batch` makes it (keys, shapes, dtypes)."""
    from sem_jax.rl.batch import widest_batch
    prompt, resp = 37, 90
    trajs = [Trajectory(0, list(range(1, prompt + 1)), np.arange(resp, dtype=np.int32), np.ones(resp, np.int8),
                        np.zeros(resp, np.float32), 0, [], "", "eos"),
             Trajectory(0, list(range(1, prompt + 1)), np.arange(5, dtype=np.int32), np.ones(5, np.int8),
                        np.zeros(5, np.float32), 0, [], "", "eos")]
    batch = build_batch(trajs, np.zeros(2), micro_batch=4, group_size=2)
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == \
        {k: (shape, np.dtype(dt)) for k, (shape, dt) in widest_batch(4, prompt, resp).items()}


def test_response_window_batch_is_the_full_batch_cut_to_the_responses():
    """build_batch's [N, R] window: each response token sits under the mask at its column, and
    log-probs and gradients over the window equal the full-width ones at the same positions,
    also for a long prompt with a short response (window shifted left) and padding rows."""
    model = random_qwen2(4)
    graph, params = nnx.split(model)
    rng = np.random.RandomState(4)
    shapes = [(40, 5), (3, 30), (10, 12)]  # (prompt, response): T = 48, R = 32; row 0's window starts at 16
    trajs = []
    for i, (p, r) in enumerate(shapes):
        mask = np.ones(r, np.int8)
        mask[r // 3:r // 2] = 0  # inserted tokens mid-response
        trajs.append(Trajectory(i, rng.randint(0, 211, p).tolist(), rng.randint(0, 211, r).astype(np.int32), mask,
                                rng.randn(r).astype(np.float32) * mask, 0, [], "", "length"))
    adv = rng.randn(3).astype(np.float32)
    b = build_batch(trajs, adv, micro_batch=2)
    assert b["inputs"].shape == (4, 48) and b["targets"].shape == b["mask"].shape == (4, 32)
    assert b["start"].tolist() == [16, 2, 9, 0] and b["mask"][3].sum() == 0
    for i, t in enumerate(trajs):
        col = len(t.prompt_ids) - 1 - b["start"][i] + np.arange(len(t.response_ids))
        np.testing.assert_array_equal(b["targets"][i, col], t.response_ids)
        np.testing.assert_array_equal(b["mask"][i, col], t.loss_mask)
        np.testing.assert_array_equal(b["sampler_logprobs"][i, col], t.logprobs)
        assert b["mask"][i].sum() == t.loss_mask.sum()
    cols = b["start"][:, None] + np.arange(32)
    weights = jnp.asarray(rng.randn(4, 32), jnp.float32)
    full_targets = np.zeros((4, 48), np.int32)  # the full-width layout: target t is token t + 1
    for i, t in enumerate(trajs):
        seq = t.prompt_ids + t.response_ids.tolist()
        full_targets[i, :len(seq) - 1] = seq[1:]
    full_targets = jnp.asarray(full_targets)

    def window(p):
        return token_logprobs(nnx.merge(graph, p), jnp.asarray(b["inputs"]), jnp.asarray(b["targets"]), chunk=8,
                              start=jnp.asarray(b["start"]))[0]

    def full(p):
        lp = token_logprobs(nnx.merge(graph, p), jnp.asarray(b["inputs"]), full_targets, chunk=8)[0]
        return jnp.take_along_axis(lp, jnp.asarray(cols), 1)

    np.testing.assert_array_equal(np.asarray(full_targets)[np.arange(4)[:, None], cols][b["mask"] > 0],
                                  b["targets"][b["mask"] > 0])
    np.testing.assert_allclose(np.asarray(window(params))[b["mask"] > 0], np.asarray(full(params))[b["mask"] > 0],
                               atol=1e-5)
    m = jnp.asarray(b["mask"])
    g_win, g_full = (jax.grad(lambda p, f=f: jnp.sum(f(p) * weights * m))(params) for f in (window, full))
    jax.tree.map(lambda a, w: np.testing.assert_allclose(a, w, atol=1e-5), g_win, g_full)
    trainer = Trainer(model, GRPOConfig(), OptimConfig(), micro_batch=2, logprob_chunk=8)
    np.testing.assert_allclose(np.asarray(trainer.logprobs(params, b)), np.asarray(window(params)), atol=1e-5)
    with pytest.raises(ValueError, match="response window of 16 in width 48"):
        build_batch(trajs, adv, micro_batch=2, response=16)


def _groups(rng, shapes, g):
    """`g` trajectories per (prompt length, [response lengths]) entry, one prompt each."""
    trajs = []
    for i, (p, rs) in enumerate(shapes):
        prompt = rng.randint(0, 211, p).tolist()
        for r in rs:
            mask = np.ones(r, np.int8)
            mask[r // 3:r // 2] = 0
            trajs.append(Trajectory(i, prompt, rng.randint(0, 211, r).astype(np.int32), mask,
                                    rng.randn(r).astype(np.float32) * mask, 0, [], "", "length"))
    return trajs


@pytest.mark.parametrize("per_layer", [True, False])
def test_shared_prompt_groups_equal_each_row_run_alone(per_layer):
    """token_logprobs(group=G) runs each group's prompt once into a KV cache copied to its rows:
    log-probs and parameter gradients equal the rows run alone, also for a group whose window
    starts inside its prompt and for padding rows; its compiled pass does less work."""
    model = random_qwen2(6)
    graph, params = nnx.split(model)
    rng = np.random.RandomState(6)
    # T = 48, R = 32: group 0's windows start at 16 (inside its 40-token prompt), group 1's at 2.
    trajs = _groups(rng, [(40, [5, 2, 4]), (3, [30, 7, 1]), (10, [12, 20, 9])], 3)
    adv = rng.randn(9).astype(np.float32)
    b = build_batch(trajs, adv, micro_batch=6, group_size=3)
    assert b["inputs"].shape == (12, 48) and b["start"].tolist() == [16] * 3 + [2] * 3 + [9] * 3 + [0] * 3
    args = [jnp.asarray(b[k]) for k in ("inputs", "targets", "start")]
    weights = jnp.asarray(rng.randn(12, 32), jnp.float32) * jnp.asarray(b["mask"])

    @partial(jax.jit, static_argnums=1)  # compiled: op by op, the gradients took most of a minute
    def lp(p, group):
        x, y, start = args
        return token_logprobs(nnx.merge(graph, p), x, y, chunk=8, per_layer=per_layer, start=start, group=group)[0]

    np.testing.assert_allclose(np.asarray(lp(params, 3)), np.asarray(lp(params, 1)), atol=2e-5)
    grad = jax.jit(jax.grad(lambda p, g: jnp.sum(lp(p, g) * weights)), static_argnums=1)
    g_shared, g_alone = (grad(params, g) for g in (3, 1))
    # Sums over a group's rows in another order: rounding relative to each gradient's scale.
    jax.tree.map(lambda a, w: np.testing.assert_allclose(a, w, atol=1e-5 * np.abs(w).max()), g_shared, g_alone)
    flops = {g: lp.lower(params, g).compile().cost_analysis()["flops"] for g in (3, 1)}
    assert flops[3] < 0.85 * flops[1], flops
    if per_layer:
        return  # the trainer passes per_layer through to the pass checked above

    # The trainer: runs of gcd(micro_batch, G) rows share; two micro-batches of two groups each.
    trainers = {g: Trainer(model, GRPOConfig(beta=0.04), OptimConfig(lr=1e-2, eps=1.0), micro_batch=6,
                               logprob_chunk=8, per_layer=per_layer, group_size=g) for g in (3, 1)}
    assert trainers[3].share == 3 and trainers[1].share == 1
    ref = {g: t.logprobs(params, b) for g, t in trainers.items()}
    np.testing.assert_allclose(np.asarray(ref[3]), np.asarray(lp(params, 1)), atol=2e-5)
    after = {g: _params_after(t, params, b, steps=1)[0] for g, t in trainers.items()}
    jax.tree.map(lambda a, w: np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-5), after[3], after[1])


def test_build_batch_checks_groups_share_their_prompt():
    rng = np.random.RandomState(7)
    trajs = _groups(rng, [(5, [3, 4]), (6, [2, 2])], 2)
    adv = np.zeros(4, np.float32)
    assert build_batch(trajs, adv, micro_batch=2, group_size=2)["inputs"].shape[0] == 4
    with pytest.raises(ValueError, match="trajectory 2 has another prompt than trajectory 0"):
        build_batch(trajs, adv, micro_batch=2, group_size=4)
    with pytest.raises(ValueError, match="4 trajectories do not split into groups of 3"):
        build_batch(trajs, adv, micro_batch=2, group_size=3)
    with pytest.raises(ValueError, match="pass start"):
        token_logprobs(random_qwen2(7), jnp.zeros((2, 8), jnp.int32), jnp.zeros((2, 8), jnp.int32), group=2)


def _batch(rng, n=4, t=16, vocab=211):
    mask = np.zeros((n, t), np.float32)
    for i in range(n):
        mask[i, 4:4 + rng.randint(3, 12)] = 1.0
    return {"inputs": rng.randint(0, vocab, (n, t)).astype(np.int32),
            "targets": rng.randint(0, vocab, (n, t)).astype(np.int32), "mask": mask,
            "advantages": rng.randn(n).astype(np.float32),
            "sampler_logprobs": np.zeros((n, t), np.float32)}


def test_param_gradients_chain_through_numpy_grad_and_ignore_masked_tokens():
    model = random_qwen2(2)
    graph, params = nnx.split(model)
    rng = np.random.RandomState(2)
    b = _batch(rng)
    cfg = GRPOConfig(beta=0.0)

    def lp_fn(p, targets):
        return token_logprobs(nnx.merge(graph, p), jnp.asarray(b["inputs"]), targets, chunk=8)[0]

    def loss(p, targets):
        lp = lp_fn(p, targets)
        s, c, _ = grpo_loss(lp, jax.lax.stop_gradient(lp), None, jnp.asarray(b["advantages"]),
                            jnp.asarray(b["mask"]), cfg)
        return s / c

    targets = jnp.asarray(b["targets"])
    grads = jax.grad(loss)(params, targets)
    # Numpy chain rule: dL/dlp from numpy, then the model's vjp.
    lp = np.asarray(lp_fn(params, targets), np.float64)
    _, g_lp = _np_loss_and_grad(lp, lp, lp, b["advantages"].astype(np.float64), b["mask"].astype(np.float64), cfg)
    _, vjp = jax.vjp(lambda p: lp_fn(p, targets), params)
    (want,) = vjp(jnp.asarray(g_lp, jnp.float32))
    jax.tree.map(lambda a, w: np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-6), grads, want)
    # Changing targets where mask == 0 changes nothing.
    other = np.where(b["mask"] == 0, (b["targets"] + 7) % 211, b["targets"])
    grads2 = jax.grad(loss)(params, jnp.asarray(other))
    jax.tree.map(lambda a, w: np.testing.assert_array_equal(a, w), grads, grads2)


def _params_after(trainer, params, batch, steps=2):
    params = jax.tree.map(jnp.array, params)
    opt = trainer.init_opt_state(params)
    for _ in range(steps):
        params, opt, metrics = trainer.update(params, opt, batch)
    return params, metrics


def test_micro_batches_equal_one_batch_and_nan_step_is_skipped():
    model = random_qwen2(3)
    graph, params = nnx.split(model)
    batch = _batch(np.random.RandomState(3))
    # eps=1 keeps Adam's step ~linear in the gradient, so summation-order rounding in
    # tiny gradients is not amplified by 1/sqrt(v).
    optim = OptimConfig(lr=1e-1, eps=1.0, warmup_steps=0)
    p_full, m_full = _params_after(Trainer(model, GRPOConfig(beta=0), optim, micro_batch=4), params, batch)
    p_micro, m_micro = _params_after(Trainer(model, GRPOConfig(beta=0), optim, micro_batch=1), params, batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p_full, p_micro)
    np.testing.assert_allclose(float(m_full["loss"]), float(m_micro["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(m_full["grad_norm"]), float(m_micro["grad_norm"]), rtol=1e-5)
    assert int(m_full["skipped"]) == 0 and np.isfinite(float(m_full["grad_norm"]))
    assert not np.allclose(np.asarray(p_full["embed"][...]), np.asarray(params["embed"][...]))

    trainer = Trainer(model, GRPOConfig(beta=0), optim, micro_batch=2)
    bad = dict(batch, advantages=np.array([1.0, np.nan, 0.5, 0.2], np.float32))
    before = jax.tree.map(np.asarray, params)
    p_bad, m_bad = _params_after(trainer, params, bad, steps=1)
    assert int(m_bad["skipped"]) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, p_bad), before)


def test_reference_pass_skipped_when_beta_is_zero():
    model = random_qwen2(4)
    _, params = nnx.split(model)
    batch = _batch(np.random.RandomState(4))
    t0 = Trainer(model, GRPOConfig(beta=0.0), OptimConfig(), micro_batch=2)
    assert t0.reference_logprobs(params, batch) is None and t0.ref_passes == 0
    t1 = Trainer(model, GRPOConfig(beta=0.04), OptimConfig(), micro_batch=2)
    ref = t1.reference_logprobs(params, batch)
    assert t1.ref_passes == 1 and ref.shape == batch["inputs"].shape
    # KL against itself is zero.
    opt = t1.init_opt_state(params)
    _, _, metrics = t1.update(jax.tree.map(jnp.array, params), opt, batch, ref)
    assert abs(float(metrics["kl"])) < 1e-6


def test_reference_weights_in_the_compute_dtype_give_the_same_logprobs():
    """float32 master weights, bfloat16 compute: the frozen reference is a bfloat16 copy
    (train.reference_weights) and its log-probs are those of the float32 weights; with nothing to
    cast it is a copy, not the donated parameters themselves."""
    from sem_jax.train import reference_weights

    model = random_qwen2(4)
    model.dtype = jnp.bfloat16
    _, params = nnx.split(model)
    ref = reference_weights(params, jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(ref)} == {jnp.dtype(jnp.bfloat16)}
    batch = _batch(np.random.RandomState(4))
    trainer = Trainer(model, GRPOConfig(beta=0.04), OptimConfig(), micro_batch=2)
    np.testing.assert_array_equal(np.asarray(trainer.reference_logprobs(ref, batch)),
                                  np.asarray(trainer.reference_logprobs(params, batch)))
    same = reference_weights(params, jnp.float32)
    for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(params)):
        assert a is not b and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("sharded", [False, True])
def test_update_compiles_once(sharded):
    """Step 2 used to compile the update again: optax's step count starts uncommitted."""
    from sem_jax.sharding import make_mesh, shard_params
    model = random_qwen2(5)
    _, params = nnx.split(model)
    # Committed as loaded weights are (uncommitted inputs recompile for their own reason).
    params = shard_params(params, make_mesh(1, -1, 1)) if sharded else jax.device_put(params, jax.devices()[0])
    batch = _batch(np.random.RandomState(5))
    trainer = Trainer(model, GRPOConfig(beta=0), OptimConfig(lr=1e-3), micro_batch=2)
    opt = trainer.init_opt_state(params)
    for _ in range(3):
        params, opt, metrics = trainer.update(params, opt, batch)
    assert int(metrics["skipped"]) == 0
    assert trainer.update_fn._cache_size() == 1


@pytest.mark.parametrize("schedule,warmup,expected", [
    # Hand-computed: cosine 0.5 * (1 + cos(pi * t / 4)); warmup ramps linearly from 0.
    ("cosine", 0, [1.0, 0.853553, 0.5, 0.146447, 0.0]),
    ("cosine", 2, [0.0, 0.5, 1.0, 0.5, 0.0]),
    ("constant", 0, [1.0, 1.0, 1.0, 1.0, 1.0]),
    ("constant", 2, [0.0, 0.5, 1.0, 1.0, 1.0]),
])
def test_learning_rate_schedule_and_the_steps_adamw_takes(schedule, warmup, expected):
    from sem_jax.rl.trainer import learning_rate, make_optimizer
    cfg = OptimConfig(lr=1.0, schedule=schedule, warmup_steps=warmup, total_steps=4, weight_decay=0.0)
    np.testing.assert_allclose([float(learning_rate(cfg)(t)) for t in range(5)], expected, atol=1e-6)
    # With a constant gradient Adam's bias-corrected direction is sign(g): each step moves every
    # parameter by exactly the scheduled rate.
    tx = make_optimizer(cfg)
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    grads = {"w": jnp.array([0.3, -0.4])}
    for t in range(4):
        updates, state = tx.update(grads, state, params)
        np.testing.assert_allclose(np.asarray(updates["w"]), [-expected[t], expected[t]], atol=1e-5)
    with pytest.raises(ValueError, match="schedule='linear'"):
        learning_rate(OptimConfig(schedule="linear"))
