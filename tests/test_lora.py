"""LoRA (`sem_jax.model.lora`): gradients against the dense-delta chain rule, the frozen layers'
backward skipped, merged weights against the adapted forward, rank 0 unchanged, exact resume,
the base checked on resume and on evaluation, export of merged weights and of PEFT adapters."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sem_jax.checkpoint import Checkpointer
from sem_jax.errors import Refused
from sem_jax.model import Qwen2, Qwen2Config, lora
from sem_jax.rl.loss import GRPOConfig, grpo_loss, token_logprobs
from sem_jax.rl.trainer import OptimConfig, Trainer
from subprocs import cpu_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4, num_kv_heads=2)
SPEC = lora.LoraSpec(rank=4, alpha=8.0, targets=("q", "v", "o", "down", "up"), first=2, num_layers=4)


def _batch(rows=4, width=16, seed=0):
    rng = np.random.RandomState(seed)
    return {"inputs": rng.randint(0, 64, (rows, width)).astype(np.int32),
            "targets": rng.randint(0, 64, (rows, width)).astype(np.int32),
            "mask": (rng.rand(rows, width) < 0.8).astype(np.float32), "advantages": rng.randn(rows).astype(np.float32),
            "sampler_logprobs": np.full((rows, width), -4.0, np.float32)}


@pytest.fixture(scope="module")
def model():
    return Qwen2(CFG, rngs=nnx.Rngs(0))


def _adapters(seed=1):
    """Adapters with B nonzero (fresh ones have B = 0 and a zero delta)."""
    ad = lora.init_adapters(SPEC, CFG, seed)
    return jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(seed + 7), x.shape), ad)


def _with_kernels(base, kernels):
    out = jax.tree.map(lambda x: x, base)
    for name, k in kernels.items():
        out["layers"][name] = out["layers"][name].replace(k)
    return out


@pytest.mark.parametrize("per_layer", [True, False])
def test_gradients_match_the_dense_delta_chain_rule(model, per_layer):
    """d loss / dA = scale * G @ B^T and d loss / dB = scale * A^T @ G, G the gradient with
    respect to the merged kernel (computed by autodiff through a plain merged model)."""
    graphdef, base = nnx.split(model)
    ad, batch = _adapters(), {k: jnp.asarray(v) for k, v in _batch().items()}
    trainer = Trainer(model, GRPOConfig(beta=0.0), OptimConfig(), micro_batch=2, per_layer=per_layer, lora=SPEC)
    weights = lambda lp: jnp.sum(lp * batch["advantages"][:, None])
    g_ad = jax.grad(lambda a: weights(trainer._token_logprobs(base, a, batch)[0]))(ad)
    merged = lora.merge(SPEC, base, ad)
    names = [lora.TARGETS[t][0] for t in SPEC.targets]
    g_k = jax.grad(lambda ks: weights(token_logprobs(nnx.merge(graphdef, _with_kernels(base, ks)), batch["inputs"],
                                                     batch["targets"])[0]))(
        {n: merged["layers"][n][...] for n in names})
    for t, n in zip(SPEC.targets, names):
        g = np.asarray(g_k[n][SPEC.first:]).reshape(SPEC.adapted, *lora.matrix_dims(CFG, t))
        a, b = np.asarray(ad[t]["a"]), np.asarray(ad[t]["b"])
        np.testing.assert_allclose(g_ad[t]["a"], SPEC.scale * np.einsum("lio,lro->lir", g, b), atol=2e-6, rtol=1e-4)
        np.testing.assert_allclose(g_ad[t]["b"], SPEC.scale * np.einsum("lir,lio->lro", a, g), atol=2e-6, rtol=1e-4)
        assert np.abs(g_ad[t]["b"]).max() > 1e-3  # a real gradient, not zeros on both sides
        # The frozen layers below are not adapted, and their kernels have gradients of their own.
        assert np.abs(np.asarray(g_k[n][:SPEC.first])).max() > 0


def _dots(spec, model, batch):
    trainer = Trainer(model, GRPOConfig(beta=0.0), OptimConfig(), micro_batch=4, per_layer=True, lora=spec)
    _, base = nnx.split(model)
    ad = lora.init_adapters(spec, CFG)
    jaxpr = jax.make_jaxpr(jax.grad(lambda a: jnp.sum(trainer._token_logprobs(base, a, batch)[0])))(ad)
    return str(jaxpr).count("dot_general")


def test_the_backward_pass_stops_at_the_lowest_adapted_layer(model):
    """With per-layer weights a frozen layer runs forward only: each layer fewer in the adapted
    range removes its backward dots from the gradient program, and nothing else."""
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    spec = lambda first: lora.LoraSpec(rank=2, alpha=4.0, targets=("q",), first=first, num_layers=4)
    counts = [_dots(spec(first), model, batch) for first in (0, 1, 2, 3)]
    steps = np.diff(counts)
    assert (steps < 0).all() and len(set(steps.tolist())) == 1, counts  # the same saving per frozen layer
    # A frozen layer's forward has 7 projections and 2 attention dots; its backward would have two
    # dots for each of those that carry a gradient back to the layer below (at least 9 more).
    assert -steps[0] >= 9, counts


@pytest.mark.parametrize("per_layer", [True, False])
def test_merged_weights_give_the_adapted_forward(model, per_layer):
    """The sampler's merged weights and the trainer's adapted layers are one policy."""
    _, base = nnx.split(model)
    ad, batch = _adapters(), _batch()
    trainer = Trainer(model, GRPOConfig(beta=0.0), OptimConfig(), micro_batch=2, per_layer=per_layer, lora=SPEC)
    merged_lp = trainer.logprobs(lora.merge(SPEC, base, ad), batch)
    adapted_lp = jax.jit(lambda b, a: trainer._token_logprobs(b, a, {k: jnp.asarray(v) for k, v in batch.items()})[0])(
        base, ad)
    np.testing.assert_allclose(merged_lp, adapted_lp, atol=2e-5)
    base_lp = trainer.logprobs(base, batch)
    assert np.abs(np.asarray(merged_lp) - np.asarray(base_lp)).max() > 1e-3  # the adapters change the policy


def test_fresh_adapters_start_as_the_base_and_merge_only_the_top_layers(model):
    _, base = nnx.split(model)
    fresh = lora.merge(SPEC, base, lora.init_adapters(SPEC, CFG))
    for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(base)):
        np.testing.assert_array_equal(a, b)
    merged = lora.merge(SPEC, base, _adapters())
    for t in SPEC.targets:
        n = lora.TARGETS[t][0]
        np.testing.assert_array_equal(merged["layers"][n][...][:SPEC.first], base["layers"][n][...][:SPEC.first])
        assert not np.array_equal(merged["layers"][n][...][SPEC.first:], base["layers"][n][...][SPEC.first:])
    assert lora.fingerprint(merged) != lora.fingerprint(base)
    assert lora.fingerprint(base) == lora.fingerprint(jax.tree.map(jnp.copy, base))


class _Before(Trainer):
    """The trainer's log-prob call as it was before LoRA (per_layer handed to token_logprobs)."""

    def _token_logprobs(self, params, adapters, mb):
        start = mb.get("start")
        return token_logprobs(nnx.merge(self.graphdef, params), mb["inputs"], mb["targets"], self.chunk,
                              segment_ids=mb.get("segment_ids"), per_layer=self.per_layer, start=start,
                              group=1 if start is None else self.share, unroll_head=self.unroll_head)


def test_rank_zero_is_the_full_fine_tune_bit_for_bit(model):
    _, params = nnx.split(model)
    batch = _batch()
    outs = []
    for cls in (Trainer, _Before):
        trainer = cls(model, GRPOConfig(beta=0.0), OptimConfig(lr=1e-3), micro_batch=2, lora=None)
        p = jax.tree.map(jnp.copy, params)
        p, _, m = trainer.update(p, trainer.init_opt_state(p), batch)
        outs.append((jax.tree.leaves(p), m))
    for a, b in zip(outs[0][0], outs[1][0]):
        np.testing.assert_array_equal(a, b)
    assert float(outs[0][1]["loss"]) == float(outs[1][1]["loss"])


def test_lora_update_is_adam_on_the_adapters_alone(model):
    """One update moves the adapters by AdamW's first step (sign of the gradient times lr) and
    leaves the base untouched; a trainer without a base is refused."""
    _, base = nnx.split(model)
    before = [np.asarray(x) for x in jax.tree.leaves(base)]
    trainer = Trainer(model, GRPOConfig(beta=0.0), OptimConfig(lr=1e-2, weight_decay=0.0, grad_clip=0.0),
                      micro_batch=2, lora=SPEC)
    ad, batch = _adapters(), _batch()
    grads = jax.grad(lambda a: _loss(trainer, base, a, batch))(ad)
    new, _, m = trainer.update(jax.tree.map(jnp.copy, ad), trainer.init_opt_state(ad), batch, base=base)
    for t in SPEC.targets:
        for k in ("a", "b"):
            g = np.asarray(grads[t][k])
            moved = np.asarray(new[t][k]) - np.asarray(ad[t][k])
            big = np.abs(g) > 1e-4
            np.testing.assert_allclose(moved[big], -1e-2 * np.sign(g[big]), rtol=1e-3)
    for x, y in zip(before, jax.tree.leaves(base)):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="base"):
        trainer.update(new, trainer.init_opt_state(new), batch)


def _loss(trainer, base, ad, batch):
    mb = {k: jnp.asarray(v) for k, v in batch.items()}
    lp, _ = trainer._token_logprobs(base, ad, mb)
    loss, count, _ = grpo_loss(lp, jax.lax.stop_gradient(lp), None, mb["advantages"], mb["mask"], trainer.grpo)
    return loss / count


def test_spec_of_the_config_section():
    from sem_jax.config import Lora
    assert lora.spec_of(Lora(), CFG) is None
    s = lora.spec_of(Lora(rank=8, alpha=16.0, targets="q, down", layers=3), CFG)
    assert (s.first, s.adapted, s.targets, s.scale) == (1, 3, ("q", "down"), 2.0)
    with pytest.raises(Refused, match="config.lora.layers=5"):
        lora.spec_of(Lora(rank=8, layers=5), CFG)
    with pytest.raises(Refused, match="config.lora.targets"):
        lora.spec_of(Lora(rank=8, targets="q,mlp"), CFG)


# -- end to end: train, resume, evaluate and export a LoRA run --------------------------------
# The random-init model of configs/cpu.py: its groups tie at these sizes (no reward signal), so B
# stays 0 and AdamW's weight decay moves A alone; the export test writes adapters that change the model.

def _train(run_dir, *extra, check=True):
    cmd = [sys.executable, "-m", "sem_jax.train", "--config", os.path.join(REPO, "configs", "cpu.py"),
           f"--config.run_dir={run_dir}", "--config.train.total_steps=2", "--config.train.ckpt_every=1",
           "--config.train.eval_at_start=False", "--config.data.eval_questions=2", "--config.rollout.max_new_tokens=24",
           "--config.data.prompts_per_step=2", "--config.rollout.group_size=2", "--config.rl.micro_batch=4",
           "--config.rl.beta=0.04", "--config.optim.lr=0.01", "--config.optim.warmup_steps=0",
           "--config.lora.rank=4", "--config.lora.layers=1", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=cpu_env())
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _base(run_dir, seed=None):
    """The random-init base a run trained on (its seed's), its config and spec."""
    from sem_jax.assemble import build_policy
    from sem_jax.config import run_config
    cfg = run_config(str(run_dir), "")
    if seed is not None:
        cfg = cfg.replace(seed=seed)
    model, _ = build_policy(cfg, None, str(run_dir))
    return model, cfg, lora.spec_of(cfg.lora, model.config)


def _adapters_at(run_dir, step):
    model, _, spec = _base(run_dir)
    like = jax.eval_shape(lambda: lora.init_adapters(spec, model.config))
    params, _ = Checkpointer(os.path.join(run_dir, "ckpt"), read_only=True).restore_params(step, like)
    return params


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("lora") / "run"
    proc = _train(run)
    assert "LoRA rank 4, alpha 32 on q,k,v,o,gate,up,down of layers 3-3" in proc.stdout
    return run


def test_a_lora_run_resumes_exactly_and_refuses_another_base(lora_run, tmp_path):
    b = tmp_path / "b"
    _train(b, "--config.train.total_steps=1")
    resumed = _train(b)
    assert "resumed from step 1" in resumed.stdout
    two = _adapters_at(lora_run, 2)
    for x, y in zip(jax.tree.leaves(two), jax.tree.leaves(_adapters_at(b, 2))):
        np.testing.assert_array_equal(x, y)
    one = _adapters_at(lora_run, 1)
    assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(one), jax.tree.leaves(two)))
    # Another base (the random-init model of another seed): refused by name, as a resume that
    # changes what trains; without the run's config.json, by the base's fingerprint.
    proc = _train(b, "--config.train.total_steps=3", "--config.seed=5", check=False)
    assert proc.returncode != 0 and "a resumed run cannot change what it trains (seed: 0 -> 5)" in proc.stderr
    (b / "config.json").unlink()
    proc = _train(b, "--config.train.total_steps=3", "--config.seed=5", check=False)
    assert proc.returncode != 0
    assert "adapters were trained on a base with fingerprint" in proc.stdout + proc.stderr


def test_a_lora_run_exports_merged_weights_and_peft_adapters(lora_run, tmp_path):
    """The merged HF directory, and the PEFT adapters on the base, give transformers the logits
    of the policy sem_jax evaluates (the checkpoint's adapters merged into the base)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import shutil
    from sem_jax.assemble import restore_policy
    from sem_jax.export import export
    from sem_jax.model import save_pretrained
    from sem_jax.config import run_config

    # A copy of the run whose checkpoint holds adapters that change the model, written as training writes it.
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.json", "tokenizer"):
        (shutil.copytree if name == "tokenizer" else shutil.copy)(lora_run / name, run / name)
    base, _, spec = _base(run)
    trained = jax.tree.map(lambda x: x + 0.02 * jax.random.normal(jax.random.key(0), x.shape),
                           lora.init_adapters(spec, base.config))
    ckpt = Checkpointer(str(run / "ckpt"), async_save=False)
    ckpt.save(2, trained, {"count": jnp.zeros(())}, {"step": 2, "lora_base": lora.fingerprint(nnx.split(base)[1])})
    ckpt.close()
    merged_dir, adapter_dir, base_dir = tmp_path / "merged", tmp_path / "adapters", tmp_path / "base"
    assert export(str(run / "ckpt"), str(merged_dir), dtype="float32") == 2
    assert export(str(run / "ckpt"), str(adapter_dir), adapters=True) == 2
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["layers_to_transform"]) == (4, 32.0, [3])
    save_pretrained(base, str(base_dir))
    ids = np.random.RandomState(0).randint(0, base.config.vocab_size, (2, 12))
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(str(merged_dir)).eval()(torch.tensor(ids)).logits.numpy()
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir)).eval()
        plain = hf_base(torch.tensor(ids)).logits.numpy()
        adapted = peft.PeftModel.from_pretrained(hf_base, str(adapter_dir)).eval()(torch.tensor(ids)).logits.numpy()
    assert np.abs(plain - want).max() > 1e-4  # the adapters changed the model
    np.testing.assert_allclose(adapted, want, atol=1e-4)
    restore_policy(run_config(str(run), ""), Checkpointer(str(run / "ckpt"), read_only=True), None, base)
    np.testing.assert_allclose(np.asarray(base(jnp.asarray(ids))), want, atol=1e-4)


def test_restoring_adapters_onto_another_base_is_refused(lora_run):
    from sem_jax.assemble import restore_policy
    other, cfg, _ = _base(lora_run, seed=3)
    with pytest.raises(Refused, match="fingerprint"):
        restore_policy(cfg, Checkpointer(os.path.join(lora_run, "ckpt"), read_only=True), None, other)


def test_export_never_replaces_the_base_model_it_reads(tmp_path):
    """Refused before any work, whatever the flags: the run's model.path is what export reads."""
    from sem_jax.export import export
    from sem_jax.config import Config
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    (run / "config.json").write_text(Config().replace(**{"model.path": str(base)}).to_json())
    with pytest.raises(Refused, match=f"is {base}, which this job reads"):
        export(str(run / "ckpt"), str(base), overwrite=True)
    assert (base / "config.json").read_text() == "{}"


def test_the_residuals_the_update_starts_from_equal_a_fresh_forward(qwen25_tokenizer):
    """The sampler keeps the residual stream entering the lowest adapted layer at every position
    (prompt, sampled and inserted tokens, groups split over slots, rows narrowed); it equals one
    fresh forward over the trajectory's tokens, and the trainer's log-probs and LoRA gradients
    from it equal those of the whole forward."""
    from policies import random_qwen2
    from test_rollout import ENGINE_BASE, SlowRetriever, _scripted_workload, DOCS
    from sem_jax.protocol import SEM
    from sem_jax.retrieval import Retriever
    from sem_jax.rl.batch import build_batch
    from sem_jax.sampling import RolloutConfig, Sampler, SamplingConfig, build_stop_automaton, rollout

    tok = qwen25_tokenizer
    cfg = Qwen2Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                      num_kv_heads=2, rope_theta=1e6)
    model = random_qwen2(3, cfg, scale=0.2)
    spec = lora.LoraSpec(rank=2, alpha=4.0, targets=("q", "down"), first=2, num_layers=4)
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    prompts = [enc("Q: capital?"), enc("Where is the Nile and how high is Everest, and why?")]
    sampler = Sampler(model, build_stop_automaton(tok, SEM.stop_strings, 151936),
                      SamplingConfig(max_new_tokens=40, eos_ids=(151645,), max_inserted_tokens=200),
                      window_steps=8, resid_layer=spec.first)
    retriever = SlowRetriever(Retriever.build(DOCS, show_progress=False), 0.01)
    # Groups split, rows moved.
    rc = RolloutConfig(group_size=2, slots=3, narrow=True, narrow_floor=1, chunk_steps=3, **ENGINE_BASE)
    trajs, _ = rollout(sampler, tok, retriever, prompts, jax.random.key(1), rc,
                       script=_scripted_workload(tok, 4, 48))
    assert sum(t.num_searches for t in trajs) >= 2  # inserted blocks among the positions
    fresh = jax.jit(lambda ids: model.hidden_states(ids, cache=model.init_cache(1, ids.shape[1], per_layer=True,
                                                                                resid_layer=spec.first),
                                                    layers=model.layer_list())[1].resid)
    for t in trajs:
        ids = np.array(list(t.prompt_ids) + t.response_ids.tolist())[None, :-1]
        assert t.resid.shape == (ids.shape[1], cfg.hidden_size)
        np.testing.assert_allclose(t.resid, np.asarray(fresh(jnp.asarray(ids)))[0], atol=2e-5, rtol=1e-4)

    batch = build_batch(trajs, np.random.RandomState(0).randn(len(trajs)).astype(np.float32), micro_batch=2,
                        group_size=2)
    assert batch["resid"].shape[:2] == batch["inputs"].shape
    without = {k: v for k, v in batch.items() if k != "resid"}
    trainer = Trainer(model, GRPOConfig(beta=0.0), OptimConfig(), micro_batch=2, per_layer=True, group_size=2,
                      lora=spec)
    _, base = nnx.split(model)
    real = batch["mask"] > 0  # sampled targets (past a row's end the inputs are padding either way)
    np.testing.assert_allclose(np.asarray(trainer.logprobs(base, batch))[real],
                               np.asarray(trainer.logprobs(base, without))[real], atol=5e-5)
    ad = _adapters_for(spec, cfg)
    grad = lambda b: jax.grad(lambda a: _loss(trainer, base, a, b))(ad)
    for x, y in zip(jax.tree.leaves(grad(batch)), jax.tree.leaves(grad(without))):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-3)
    assert max(np.abs(np.asarray(x)).max() for x in jax.tree.leaves(grad(batch))) > 1e-4


def _adapters_for(spec, cfg):
    ad = lora.init_adapters(spec, cfg, 1)
    return jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(9), x.shape), ad)


_TWO_LORA = textwrap.dedent("""
    import math, sys
    import jax
    if sys.argv[2] != "single":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    import jax.numpy as jnp, numpy as np
    from flax import nnx
    sys.path.insert(0, "tests")
    from policies import random_qwen2
    from sem_jax import hosts
    from sem_jax.model import Qwen2Config, lora
    from sem_jax.rl.batch import batch_width, build_batch, response_width
    from sem_jax.rl.loss import GRPOConfig
    from sem_jax.rl.trainer import OptimConfig, Trainer
    from sem_jax.sampling import Trajectory
    from sem_jax.sharding import make_mesh, replicate, shard_params
    V, G, ROWS = 256, 2, 8
    cfg = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2)
    model = random_qwen2(3, cfg, scale=0.2)
    spec = lora.LoraSpec(rank=2, alpha=4.0, targets=("q", "v", "down"), first=1, num_layers=3)
    mesh = make_mesh(fsdp=-1)  # 4 devices: 2 a process, or the one process's 4
    resid = jax.jit(lambda ids: model.hidden_states(ids, cache=model.init_cache(1, ids.shape[1], per_layer=True,
                                                                                resid_layer=spec.first),
                                                    layers=model.layer_list())[1].resid)
    WIDE = 24  # every row's ids padded to one width (one compile): causal, so a prefix's residuals are its own
    rng = np.random.RandomState(0)
    trajs = []
    for q in range(ROWS // G):
        prompt = rng.randint(0, V, 5 + q).tolist()
        for _ in range(G):
            resp = rng.randint(0, V, rng.randint(3, 9))
            ids = prompt + resp.tolist()[:-1]
            wide = np.zeros((1, WIDE), np.int32)
            wide[0, :len(ids)] = ids
            trajs.append(Trajectory(q, prompt, resp, np.ones(len(resp), np.int8),
                                    np.full(len(resp), -math.log(V), np.float32), 0, [], "", "length",
                                    resid=np.asarray(resid(jnp.asarray(wide)))[0, :len(ids)]))
    adv = rng.randn(ROWS).astype(np.float32)
    n, pid = jax.process_count(), jax.process_index()
    mine = slice(pid * ROWS // n, (pid + 1) * ROWS // n)  # each process its half of the groups, as training
    trainer = Trainer(model, GRPOConfig(beta=0.0), OptimConfig(lr=1e-2, weight_decay=0.0), micro_batch=4,
                      per_layer=True, group_size=G, shards=hosts.batch_shards(mesh), lora=spec)
    width, response = (hosts.agree_max(f(trajs[mine])) for f in (batch_width, response_width))
    rows = int(np.lcm.reduce([trainer.micro_batch // n, hosts.local_batch_multiple(mesh), trainer.share]))
    host = build_batch(trajs[mine], adv[mine], micro_batch=rows, width=width, response=response, group_size=G)
    assert "resid" in host
    with jax.set_mesh(mesh):
        batch = {k: hosts.to_global(v, mesh) for k, v in host.items()}
        base = shard_params(nnx.split(model)[1], mesh)
        params = replicate(lora.init_adapters(spec, cfg, 0), mesh)
        opt = trainer.init_opt_state(params)
        for _ in range(2):  # the first step moves B alone (it starts at 0), the second A too
            params, opt, m = trainer.update(params, opt, batch, None, base=base)
    flat = {f"{t}.{k}": np.asarray(v.addressable_data(0)) for t, ab in params.items() for k, v in ab.items()}
    if pid == 0:
        np.savez(sys.argv[3], loss=float(m["loss"]), grad_norm=float(m["grad_norm"]), **flat)
    print("ok", pid)
""")


def test_two_processes_update_lora_adapters_as_one(tmp_path):
    """Two processes (2 CPU devices each, gloo) take LoRA steps on the 4-device FSDP mesh, each
    from its half of the rows and their residual streams at the lowest adapted layer; the adapters
    after two steps are those one process on 4 devices reaches from all the rows."""
    from subprocs import free_address, run_together

    addr = free_address()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = lambda mode, out: [sys.executable, "-c", _TWO_LORA, addr, mode, str(out)]
    outs = run_together([(argv("0", tmp_path / "two.npz"), 2), (argv("1", tmp_path / "unused.npz"), 2),
                         (argv("single", tmp_path / "one.npz"), 4)], repo, timeout=300)
    assert all("ok" in out for out in outs), outs
    two, one = np.load(tmp_path / "two.npz"), np.load(tmp_path / "one.npz")
    assert sorted(two.files) == sorted(one.files) and len(one.files) == 2 + 2 * 3
    for name in one.files:
        np.testing.assert_allclose(two[name], one[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert all(np.abs(one[f"{t}.a"]).max() > 0 and np.abs(one[f"{t}.b"]).max() > 0 for t in ("q", "v", "down"))
    assert float(one["grad_norm"]) > 0
