"""The compiled sampler on a random tiny Qwen2."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from policies import TINY, random_qwen2

from sem_jax import hosts
from sem_jax.sampling import Sampler, SamplingConfig, sample_tokens, stop_automaton_from_bytes
from sem_jax.sampling import sampler as sm

# Token i is one lower-case letter: "</search>" can never appear.
NO_STOP = stop_automaton_from_bytes([bytes([97 + i % 26]) for i in range(TINY.vocab_size)], ("</search>",))


@pytest.mark.parametrize("window_steps,per_layer", [(0, False), (1, True)])
def test_greedy_equals_argmax_loop_over_full_forward(window_steps, per_layer):
    """Also with the attention window grown in small steps (16, 24, 32, then the whole cache),
    with the stacked layers (scanned) and with per-layer weights and cache."""
    model = random_qwen2()
    prompts = [[5, 17, 42], [9, 1, 2, 3, 4, 5, 6, 7, 8, 100], [33]]
    steps = 24
    sampler = Sampler(model, NO_STOP, SamplingConfig(max_new_tokens=steps, greedy=True),
                      calls=hosts.CallLog(True), window_steps=window_steps, per_layer=per_layer)
    state = sampler.decode(sampler.start(prompts, 2, jax.random.key(0)))
    assert isinstance(state.cache.k, tuple) == per_layer
    windows = [c.split("[")[0] for c in sampler.calls.calls if c.startswith("decode")]
    assert windows == (["decode@40"] if window_steps == 0 else ["decode@16", "decode@24", "decode@32", "decode@40"])
    resp, lens = np.asarray(state.resp), np.asarray(state.resp_len)
    assert (lens == steps).all() and np.asarray(state.done).all()
    logprob = np.asarray(state.resp_logprob)
    forward = jax.jit(lambda m, t: jax.nn.log_softmax(m(t), -1))
    for i, p in enumerate(prompts):
        seq, want_lp = list(p), []
        for _ in range(steps):
            # Right padding to one width (one compile); causal, so padding cannot leak back.
            padded = jnp.asarray([seq + [0] * (48 - len(seq))])
            logp = np.asarray(forward(model, padded))[0, len(seq) - 1]
            seq.append(int(np.argmax(logp)))
            want_lp.append(logp[seq[-1]])
        want = seq[len(p):]
        for g in range(2):
            assert resp[2 * i + g].tolist() == want
            np.testing.assert_allclose(logprob[2 * i + g], want_lp, atol=1e-4)


def test_eos_stops_row_and_group_copies_differ_when_sampling():
    model = random_qwen2(1)
    cfg = SamplingConfig(max_new_tokens=20, temperature=1.0, eos_ids=(3, 4, 5))
    sampler = Sampler(model, NO_STOP, cfg)
    state = sampler.decode(sampler.start([[1, 2, 3]], 8, jax.random.key(1)))
    resp, lens, eos = np.asarray(state.resp), np.asarray(state.resp_len), np.asarray(state.eos)
    for row in range(8):
        n = lens[row]
        body = resp[row, :n].tolist()
        if eos[row]:
            assert body[-1] in (3, 4, 5) and not set(body[:-1]) & {3, 4, 5}
        else:
            assert n == 20 and not set(body) & {3, 4, 5}
    assert len({tuple(resp[r, :lens[r]]) for r in range(8)}) > 1  # G copies sample independently


@pytest.mark.parametrize("window_steps,per_layer,chunk", [(0, True, 256), (3, False, 2), (3, True, 4)])
def test_continuation_after_insertion_equals_full_forward(window_steps, per_layer, chunk):
    """Tokens appended mid-sequence into the live cache: later logprobs == full forward
    (also when decode and insert read only a window of the cache; stacked or per-layer; the
    inserted tokens in passes of `chunk`)."""
    model = random_qwen2(2)
    prompts = [[7, 8, 9, 10], [11, 12]]
    sampler = Sampler(model, NO_STOP, SamplingConfig(max_new_tokens=30, temperature=1.0),
                      max_steps_per_call=5, window_steps=window_steps, per_layer=per_layer, insert_chunk=chunk)
    state = sampler.decode(sampler.start(prompts, 1, jax.random.key(2)))
    assert np.asarray(state.resp_len).tolist() == [5, 5]
    state = sampler.insert(state, [[100, 101, 102], [150]])
    state = sampler.decode(state)
    # 16 tokens on a row of 13 under a 24-slot window: the later passes read past the window.
    state = sampler.insert(state, [[], list(range(20, 36))])
    state = sampler.decode(state)
    resp, lp, sampled, lens = map(np.asarray, (state.resp, state.resp_logprob, state.resp_sampled,
                                               state.resp_len))
    worst = 0.0
    for row, p in enumerate(prompts):
        n = lens[row]
        seq = np.array(list(p) + resp[row, :n].tolist())
        full = jax.nn.log_softmax(model(jnp.asarray(seq[None]))[0], -1)
        ref = np.asarray(full[len(p) - 1:-1])[np.arange(n), resp[row, :n]]
        mask = sampled[row, :n]
        assert mask.sum() == n - (3 if row == 0 else 17)
        worst = max(worst, np.abs(ref - lp[row, :n])[mask].max())
    print(f"max |sampler logprob - full forward| = {worst:.3g}")
    assert worst <= 1e-4


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.5), (20, 0.3)])
def test_top_k_top_p_support(top_k, top_p):
    logits = jax.random.normal(jax.random.key(0), (4, TINY.vocab_size)) * 3
    cfg = SamplingConfig(max_new_tokens=1, top_k=top_k, top_p=top_p)
    order = np.argsort(-np.asarray(logits), -1)
    probs = np.asarray(jax.nn.softmax(logits, -1))
    allowed = []
    for r in range(4):
        cand = order[r, :top_k] if top_k else order[r]
        p = probs[r, cand] / probs[r, cand].sum()
        keep = np.cumsum(p) - p < top_p
        allowed.append(set(cand[keep].tolist()))
    seen = [set() for _ in range(4)]
    for s in range(200):
        tok, lp = sample_tokens(logits, jax.random.key(s), cfg)
        for r, t in enumerate(np.asarray(tok)):
            seen[r].add(int(t))
    for r in range(4):
        assert seen[r] <= allowed[r]
        assert len(seen[r]) >= min(2, len(allowed[r]))


def test_bad_sampling_config():
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(max_new_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(max_new_tokens=4, top_p=0.0)


def test_inverse_cdf_sampling_matches_distribution():
    """Empirical token frequencies follow softmax(logits / T) (chi-square-style bound)."""
    v = 700  # not a multiple of the chunk width
    logits = jax.random.normal(jax.random.key(3), (1, v)) * 2.0
    cfg = SamplingConfig(max_new_tokens=1, temperature=0.7)
    keys = jax.random.split(jax.random.key(4), 20000)
    toks = np.asarray(jax.vmap(lambda k: sample_tokens(logits, k, cfg)[0][0])(keys))
    probs = np.asarray(jax.nn.softmax(logits[0] / 0.7))
    counts = np.bincount(toks, minlength=v)
    top = np.argsort(-probs)[:20]
    expected = probs[top] * len(toks)
    assert np.all(np.abs(counts[top] - expected) < 5 * np.sqrt(expected) + 5)
    assert counts[probs < 1e-7].sum() == 0


def test_inverse_cdf_stops_at_the_last_entry_with_mass_when_rounding_overshoots(monkeypatch):
    """A uniform at the top of its range walks past the last chunk's mass (float rounding does
    this rarely): into an empty last chunk, or past the last nonzero entry of a chunk. The
    sample is then the last entry with mass, where the CDF reaches its top, never a
    zero-probability one."""
    from sem_jax.sampling.sampler import _inverse_cdf
    probs = np.zeros((3, 700), np.float32)
    probs[0, 10], probs[0, 300] = 1.0, 0.5  # the last chunk (512..699) is all zeros
    probs[1, 699] = 1.0                     # its walk ends on a real entry
    probs[2, 5], probs[2, 600] = 1.0, 0.25  # mass in the last chunk, whose tail is empty
    monkeypatch.setattr(jax.random, "uniform", lambda key, shape: jnp.ones(shape))
    np.testing.assert_array_equal(np.asarray(_inverse_cdf(jnp.asarray(probs), jax.random.key(0))), [300, 699, 600])


def test_argmax_matches_numpy_with_ties_and_nan():
    from sem_jax.sampling.sampler import max_argmax
    argmax = lambda x: max_argmax(x)[1]
    x = np.random.RandomState(0).randint(0, 5, (64, 300)).astype(np.float32)  # many ties
    x[5, :] = -np.inf
    x[6, 299] = 9.0  # the maximum in the last, padded chunk
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(x)), np.argmax(x, -1))
    assert argmax(jnp.asarray(x)).dtype == jnp.int32
    for width in (7, 64, 512):
        top, idx = max_argmax(jnp.asarray(x), width)
        np.testing.assert_array_equal(np.asarray(idx), np.argmax(x, -1))
        np.testing.assert_array_equal(np.asarray(top)[:, 0], np.max(x, -1))
    x[3, 7] = x[9, :] = np.nan  # a broken row still gets a valid id (a NaN's or a maximum's)
    got = np.asarray(jax.jit(argmax)(x))
    assert got[9] == 0 and (got[3] == 7 or x[3, got[3]] == np.nanmax(x[3]))


def test_vocabulary_walks_keep_tensor_sharded_logits_in_place():
    """Qwen2.5-7B's 152064 logits split over 4 devices: sampling (and the greedy argmax) gather
    only per-chunk values, never a share of the logits themselves (at a chunk width of 256 the
    594 chunks do not split 4 ways, and every device gathered half the vocabulary), and sample
    what the same call samples unsharded."""
    import re

    from jax.sharding import NamedSharding, PartitionSpec

    from sem_jax.sharding import make_mesh
    v = 152064
    mesh = make_mesh(data=2, fsdp=1, tensor=4)
    with jax.set_mesh(mesh):
        assert [sm.chunk_width(n) for n in (v, 151936, 700)] == [128, 32, 256]
    with jax.set_mesh(make_mesh(data=1, fsdp=1, tensor=8)):
        assert sm.chunk_width(v) == 64
    assert [sm.chunk_width(n) for n in (v, 151936, 700, 1088)] == [128, 128, 256, 64]
    logits = jax.random.normal(jax.random.key(0), (8, v)) * 3.0
    keys = jax.random.split(jax.random.key(1), 4)
    for cfg in (SamplingConfig(max_new_tokens=1, temperature=0.7), SamplingConfig(max_new_tokens=1, greedy=True)):
        fn = jax.jit(lambda x, k: sample_tokens(x, k, cfg))
        want = [fn(logits, k) for k in keys]
        with jax.set_mesh(mesh):
            sharded = jax.device_put(logits, NamedSharding(mesh, PartitionSpec("data", "tensor")))
            fn = jax.jit(lambda x, k: sample_tokens(x, k, cfg))
            hlo = fn.lower(sharded, keys[0]).compile().as_text()
            got = [fn(sharded, k) for k in keys]
        gathered = [np.prod([int(d) for d in dims.split(",")]) for dims in re.findall(r"= \w+\[([\d,]+)\]\S* all-gather", hlo)]
        assert max(gathered, default=0) <= 8 * v // 64, gathered
        for (t0, l0), (t1, l1) in zip(want, got):
            np.testing.assert_array_equal(np.asarray(t1), np.asarray(t0))
            np.testing.assert_allclose(np.asarray(l1), np.asarray(l0), rtol=1e-5, atol=1e-5)


def _assert_draws_follow(toks: np.ndarray, logp: np.ndarray):
    """Draws toks [draws, rows] follow the log-probabilities logp [rows, V]: each row's 10 likeliest
    tokens within 5 standard deviations of their expected counts, none of probability < 1e-7."""
    for r in range(logp.shape[0]):
        counts, probs = np.bincount(toks[:, r], minlength=logp.shape[1]), np.exp(logp[r])
        top = np.argsort(-probs)[:10]
        expected = probs[top] * toks.shape[0]
        assert np.all(np.abs(counts[top] - expected) < 5 * np.sqrt(expected) + 5), r
        assert counts[probs < 1e-7].sum() == 0


def test_spread_sampling_draws_from_the_softmax_where_the_logits_lie():
    """`sample_spread` on logits in the LM head's spread layout (8 devices: the vocabulary split 8
    ways, every row on each): greedy picks the first maximum, also across devices; sampled tokens
    follow softmax(logits / T) (the Gumbel-max trick, each device its own noise); the log-probs are
    log_softmax's. The devices exchange a few numbers per row, never a share of the logits."""
    import re

    from jax.sharding import NamedSharding

    from sem_jax.model.qwen2 import HEAD_LOGITS_AXES
    from sem_jax.sharding import logical_to_spec, make_mesh, tensor_groups

    mesh = tensor_groups(make_mesh(data=1, fsdp=-1, tensor=1), 2, spread=True)
    b, v = 6, 1000
    logits = jax.random.normal(jax.random.key(0), (b, v)) * 3.0
    logits = logits.at[2, 17].set(50.0).at[2, 900].set(50.0)  # a tie between two devices' shares
    spec = logical_to_spec(HEAD_LOGITS_AXES, logits.shape, dict(mesh.shape))
    assert spec == jax.sharding.PartitionSpec(None, ("tensor", "groups"))
    greedy, sampled = SamplingConfig(max_new_tokens=1, greedy=True), SamplingConfig(max_new_tokens=1, temperature=0.7)
    keys = jax.random.split(jax.random.key(4), 4000)
    with jax.set_mesh(mesh):
        x = jax.device_put(logits, NamedSharding(mesh, spec))
        tok, lp = jax.jit(lambda x, k: sm.sample_spread(x, k, greedy))(x, keys[0])
        draw = jax.jit(jax.vmap(lambda k, x: sm.sample_spread(x, k, sampled), in_axes=(0, None)))
        hlo = draw.lower(keys, x).compile().as_text()
        toks, lps = (np.asarray(a) for a in draw(keys, x))
    want_tok, want_lp = sample_tokens(logits, keys[0], greedy)
    assert np.asarray(tok).tolist() == np.asarray(want_tok).tolist() and int(tok[2]) == 17
    np.testing.assert_allclose(np.asarray(lp), np.asarray(want_lp), atol=1e-5)
    logp = np.asarray(jax.nn.log_softmax(logits / 0.7, -1))
    np.testing.assert_allclose(lps, np.take_along_axis(logp, toks.T, 1).T, atol=1e-5)
    _assert_draws_follow(toks, logp)
    moved = [np.prod([int(d) for d in dims.split(",")])
             for dims in re.findall(r"= \(?\w+\[([\d,]+)\]\S* (?:all-gather|all-to-all|all-reduce)", hlo)]
    assert moved and max(moved) <= 8 * len(keys) * b, moved  # 8 devices' candidates, not [rows, V]
    with pytest.raises(ValueError, match="whole vocabulary"):
        sm.sample_spread(logits, keys[0], SamplingConfig(max_new_tokens=1, top_k=5))


@pytest.mark.parametrize("v", [768, 1024])  # 96 per device: the head's slice stored transposed on a TPU
def test_head_kernel_samples_without_writing_the_logits(v):
    """`sample_spread` through `head_sampling` (interpreted; 8 devices, the head's vocabulary split 8
    ways): from the rows and the head's weight, greedy picks the first maximum of their logits
    (a tie across devices too) and sampled tokens follow softmax(logits / T), with log_softmax's
    log-probs; the noise is a function of the key, row and token id, so the draws are the mesh's
    own no more."""
    from jax.sharding import NamedSharding

    from sem_jax.sharding import logical_to_spec, make_mesh, tensor_groups

    b, e = 6, 128
    h = jax.random.normal(jax.random.key(1), (b, e))
    w = jax.random.normal(jax.random.key(2), (e, v)) * 3.0 / np.sqrt(e)
    big = h[2] / jnp.linalg.norm(h[2]) * 50.0 / jnp.linalg.norm(h[2])
    w = w.at[:, 17].set(big).at[:, v - 100].set(big)  # row 2's maximum, tied between two devices
    logits = h @ w
    greedy, sampled = SamplingConfig(max_new_tokens=1, greedy=True), SamplingConfig(max_new_tokens=1, temperature=0.7)
    keys = jax.random.split(jax.random.key(4), 2000)
    runs = {}
    for name, mesh in (("spread", tensor_groups(make_mesh(data=1, fsdp=-1, tensor=1), 2, spread=True)),
                       ("pairs", tensor_groups(make_mesh(data=1, fsdp=-1, tensor=1), 2, spread=False))):
        with jax.set_mesh(mesh):
            wp = jax.device_put(w, NamedSharding(mesh, logical_to_spec(("embed", "head_vocab"), w.shape,
                                                                       dict(mesh.shape))))
            head = lambda k, cfg: sm.sample_spread(None, k, cfg, head=(h, wp, "interpret"))
            tok, lp = jax.jit(lambda k: head(k, greedy))(keys[0])
            toks, lps = (np.asarray(a) for a in jax.jit(jax.vmap(lambda k: head(k, sampled)))(keys))
        runs[name] = toks
    want_tok, want_lp = sample_tokens(logits, keys[0], greedy)
    assert np.asarray(tok).tolist() == np.asarray(want_tok).tolist() and int(tok[2]) == 17
    np.testing.assert_allclose(np.asarray(lp), np.asarray(want_lp), atol=1e-4)
    logp = np.asarray(jax.nn.log_softmax(logits / 0.7, -1))
    np.testing.assert_allclose(lps, np.take_along_axis(logp, toks.T, 1).T, atol=1e-4)
    toks = runs["spread"]
    _assert_draws_follow(toks, logp)
    np.testing.assert_array_equal(runs["spread"], runs["pairs"])  # the vocabulary split 8 or 2 ways


def test_decode_kernels_sample_as_xla():
    """The sampler on the spread mesh (4 groups of 2) with its decode step's MLP in `fused_mlp` and
    its LM head and sampling in `head_sampling` (both interpreted): the greedy tokens and log-probs
    of XLA's dots and logits, through a decode, an insert and a decode again."""
    from policies import Qwen2Config

    from sem_jax.sharding import make_mesh, tensor_groups

    cfg = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=128, rope_theta=1e6)
    stop = stop_automaton_from_bytes([bytes([97 + i % 26]) for i in range(1024)], ("</search>",))
    model = random_qwen2(0, cfg)
    mesh = tensor_groups(make_mesh(data=1, fsdp=-1, tensor=1), 2, spread=True)
    prompts = [[5, 17, 42], [9, 1, 2, 3, 4, 5, 6, 7, 8, 100], [33], [4, 4]]
    runs = {}
    for mode in ("interpret", "xla"):
        model.decode_kernel = mode
        sampler = Sampler(model, stop, SamplingConfig(max_new_tokens=8, greedy=True), mesh=mesh, per_layer=False)
        assert model.head_kernel_mode(8) == (None if mode == "xla" else mode)
        state = sampler.decode(sampler.start(prompts, 2, jax.random.key(0)))
        state = sampler.decode(sampler.insert(state, [[1, 2, 3]] * 4 + [[]] * 4))
        runs[mode] = state
    got, want = runs["interpret"], runs["xla"]
    assert np.asarray(want.resp_len).min() > 0
    np.testing.assert_array_equal(np.asarray(got.resp), np.asarray(want.resp))
    np.testing.assert_allclose(np.asarray(got.resp_logprob), np.asarray(want.resp_logprob), atol=1e-4)


@pytest.mark.parametrize("per_layer", [False, True])
def test_sampling_from_weights_cast_to_the_compute_dtype_changes_nothing(per_layer):
    """float32 master weights, bfloat16 compute: the sampler keeps a bfloat16 copy
    (`compute_weights`), and its tokens and log-probs are those of sampling from the float32
    weights themselves (every use casts them first)."""
    from flax import nnx

    from sem_jax.sampling.sampler import compute_weights

    model = random_qwen2()
    model.dtype = jnp.bfloat16
    graphdef, params = nnx.split(model)
    cast = compute_weights(params, jnp.bfloat16)
    dtypes = {x.dtype for x in jax.tree.leaves(cast)}
    assert dtypes == {jnp.dtype(jnp.bfloat16)} and {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
    assert compute_weights(cast, jnp.bfloat16) is cast and compute_weights(params, jnp.float32) is params
    cfg = SamplingConfig(max_new_tokens=12, temperature=1.0)
    prompts = [[5, 17, 42], [9, 1, 2, 3, 4, 5, 6, 7, 8, 100]]
    sampler = Sampler(model, NO_STOP, cfg, per_layer=per_layer)
    assert {x.dtype for x in jax.tree.leaves(sampler.params)} == {jnp.dtype(jnp.bfloat16)}
    got = sampler.decode(sampler.start(prompts, 2, jax.random.key(3)))
    sampler.params = params  # the float32 weights as they are
    sampler.layers = sampler.layers and sm.layer_list(graphdef, params)
    want = sampler.decode(sampler.start(prompts, 2, jax.random.key(3)))
    np.testing.assert_array_equal(np.asarray(got.resp), np.asarray(want.resp))
    np.testing.assert_array_equal(np.asarray(got.resp_logprob), np.asarray(want.resp_logprob))



@pytest.mark.parametrize("tensor,per_layer,spread", [(4, False, False), (2, True, False), (2, False, True),
                                                     (4, True, True)])
def test_tensor_parallel_layout_samples_as_the_training_mesh(tensor, per_layer, spread):
    """The sampler on a mesh of its own (`rollout.tensor`: the 8 devices as data x `tensor`), given
    the weights in the training mesh's FSDP layout: it re-places them (each device a 1/tensor share
    of the heads, the MLP and the vocabulary, whole over the embedding; `spread`: a 1/8 share of
    the MLP), splits the KV cache by its heads and the rows over the groups, and samples the tokens
    and log-probs of the sampler on the FSDP mesh, through a decode, an insert and a decode again."""
    from flax import nnx
    from policies import Qwen2Config

    from sem_jax.sharding import make_mesh, shard_params, tensor_groups

    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                      num_kv_heads=4, rope_theta=1e6)
    stop = stop_automaton_from_bytes([bytes([97 + i % 26]) for i in range(256)], ("</search>",))
    model = random_qwen2(0, cfg)
    fsdp = make_mesh(data=1, fsdp=-1, tensor=1)
    with jax.set_mesh(fsdp):
        nnx.update(model, shard_params(nnx.state(model), fsdp))  # as the trainer holds them
    prompts = [[5, 17, 42], [9, 1, 2, 3, 4, 5, 6, 7, 8, 100], [33], [4, 4]]
    runs = {}
    for mesh in (fsdp, tensor_groups(fsdp, tensor, spread)):
        sampler = Sampler(model, stop, SamplingConfig(max_new_tokens=12, greedy=True), mesh=mesh, per_layer=per_layer)
        with jax.set_mesh(fsdp):  # the caller's mesh: the sampler runs on its own
            state = sampler.decode(sampler.start(prompts, 2, jax.random.key(0)))
            state = sampler.decode(sampler.insert(state, [[1, 2, 3]] * 4 + [[]] * 4))
        runs[mesh.shape["tensor"]] = sampler, state
    sampler, state = runs[tensor]
    groups = "groups" if spread else "data"
    assert dict(sampler.mesh.shape) == {groups: 8 // tensor, "fsdp": 1, "tensor": tensor}
    q = sampler.params["layers"]["q_kernel"][...]  # [layers, embed, heads, head_dim]
    assert q.addressable_shards[0].data.shape == (2, 64, 8 // tensor, 8)
    down = sampler.params["layers"]["down_kernel"][...]  # [layers, mlp, embed]
    assert down.addressable_shards[0].data.shape == (2, 128 // (8 if spread else tensor), 64)
    # [rows, kv_heads, head_dim, slots] per layer; stacked [layers, rows, slots, kv_heads, head_dim]
    k = state.cache.k[0] if per_layer else state.cache.k
    shard = k.addressable_shards[0].data.shape
    rows_heads = shard[:2] if per_layer else (shard[1], shard[3])
    assert rows_heads == (8 // sampler.mesh.shape[groups], 4 // tensor)  # rows over the groups, heads split
    _, want = runs[1]
    assert np.asarray(state.resp_len).tolist() == np.asarray(want.resp_len).tolist()
    np.testing.assert_array_equal(np.asarray(state.resp), np.asarray(want.resp))
    np.testing.assert_allclose(np.asarray(state.resp_logprob), np.asarray(want.resp_logprob), atol=1e-4)


def test_spread_layout_sends_the_rows_not_the_weights():
    """A decode step in tensor-parallel pairs (8 devices: 4 groups of 2), the MLP's and the LM
    head's weights split over the pairs or over all 8 (rollout.spread, a 2-D layout): the same
    logits; each device reads fewer bytes by the 3/8 of those weights it no longer holds, and the
    interconnect carries the step's rows and logits (a few KB) instead, never the weights."""
    from flax import nnx
    from policies import Qwen2Config

    from sem_jax.aot.programs import cost
    from sem_jax.sharding import batch_sharding, make_mesh, shard_params, tensor_groups

    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=1024, num_layers=2, num_heads=8,
                      num_kv_heads=4, rope_theta=1e6)
    graphdef, params = nnx.split(random_qwen2(0, cfg))
    step = jax.jit(lambda p, tokens, cache: nnx.merge(graphdef, p).extend(tokens, cache))
    runs = {}
    for spread in (False, True):
        mesh = tensor_groups(make_mesh(data=1, fsdp=-1, tensor=1), 2, spread)
        with jax.set_mesh(mesh):
            placed = shard_params(params, mesh)
            cache = jax.jit(lambda p: nnx.merge(graphdef, p).init_cache(8, 32))(placed)
            cache = step(placed, jnp.arange(8 * 5).reshape(8, 5) % 256, cache)[1]  # 5 tokens per row
            tokens = jax.device_put(jnp.arange(8)[:, None] + 7, batch_sharding(mesh, (8, 1)))
            compiled = step.lower(placed, tokens, cache).compile()
            runs[spread] = cost(compiled), np.asarray(compiled(placed, tokens, cache)[0])
    (group, want), (spread, got) = runs[False], runs[True]
    np.testing.assert_allclose(got, want, atol=1e-5)
    mlp = cfg.num_layers * 3 * cfg.hidden_size * cfg.intermediate_size * 4  # float32 bytes
    head = cfg.hidden_size * cfg.vocab_size * 4
    assert spread["bytes"] <= group["bytes"] - 0.9 * (mlp + head) * (1 / 2 - 1 / 8)
    # The [8, E] rows entering each layer's MLP and the head (each device receiving the 3/4 of them
    # its group lacks), and at most a device's share of the [8, V] float32 logits handed back to
    # each group (gathering the weights instead would send several times a device's own 1/8 share
    # of them).
    rows = (cfg.num_layers + 1) * 8 * cfg.hidden_size * 4
    logits = 8 * cfg.vocab_size * 4 / 2
    assert 3 / 4 * rows <= spread["ici"] - group["ici"] <= 4 * rows + logits < 0.2 * (mlp + head) / 8


def test_tensor_groups_refuse_what_does_not_divide():
    from sem_jax.sharding import make_mesh, tensor_groups

    mesh = make_mesh(data=2, fsdp=-1, tensor=1)
    for bad in (0, 3, 16):
        with pytest.raises(ValueError, match=f"rollout.tensor={bad} must be >= 1 and divide the 8 devices"):
            tensor_groups(mesh, bad)
    grouped = tensor_groups(mesh, 8)
    assert dict(grouped.shape) == {"data": 1, "fsdp": 1, "tensor": 8}
    assert sorted(d.id for d in grouped.devices.flat) == sorted(d.id for d in mesh.devices.flat)


def test_per_layer_defaults_by_platform():
    """The sampler runs its layers one by one on CPUs and GPUs (the scan copies each layer's slices
    there, and on a GPU transposed the whole KV cache at every step), the trainer on CPUs only; the
    fit check and the roofline's measured programs take the sampler's per-layer copies where it
    keeps them, none on a TPU."""
    from flax import nnx

    from sem_jax.aot.programs import sampler_layers
    from sem_jax.kernels.dispatch import per_layer_default

    assert [per_layer_default(sampler=True, platform=p) for p in ("cpu", "gpu", "tpu")] == [True, True, False]
    assert [per_layer_default(platform=p) for p in ("cpu", "gpu", "tpu")] == [True, False, False]
    graphdef, params = nnx.split(random_qwen2())
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    assert sampler_layers(graphdef, abstract, "tpu") is None
    copies = sampler_layers(graphdef, abstract, "gpu")
    want = sm.layer_list(graphdef, params)
    assert jax.tree.structure(copies) == jax.tree.structure(want)
    assert all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(jax.tree.leaves(copies), jax.tree.leaves(want)))
