"""LoRA (`sem_jax.model.lora`): gradients against the dense-delta chain rule, the frozen layers'
backward skipped, merged weights against the adapted forward, rank 0 unchanged, exact resume,
the base checked on resume and on evaluation, export of merged weights and of PEFT adapters."""

import json
import os
import subprocess
import sys

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
    from sem_jax.settings import Lora
    assert lora.spec_of(Lora(), CFG) is None
    s = lora.spec_of(Lora(rank=8, alpha=16.0, targets="q, down", layers=3), CFG)
    assert (s.first, s.adapted, s.targets, s.scale) == (1, 3, ("q", "down"), 2.0)
    with pytest.raises(Refused, match="config.lora.layers=5"):
        lora.spec_of(Lora(rank=8, layers=5), CFG)
    with pytest.raises(Refused, match="config.lora.targets"):
        lora.spec_of(Lora(rank=8, targets="q,mlp"), CFG)


# -- end to end: train, resume, evaluate and export a LoRA run --------------------------------

from test_train import warm_model  # noqa: E402,F401 - the tiny model taught the format (a fixture)


def _train(run_dir, model_dir, *extra, check=True):
    cmd = [sys.executable, "-m", "sem_jax.train", "--config", os.path.join(REPO, "configs", "cpu.py"),
           f"--config.run_dir={run_dir}", f"--config.model.path={model_dir}", "--config.train.total_steps=2",
           "--config.train.ckpt_every=1", "--config.train.eval_at_start=False", "--config.data.eval_questions=2",
           "--config.rollout.max_new_tokens=48", "--config.data.prompts_per_step=4", "--config.rollout.group_size=4",
           "--config.rl.micro_batch=8", "--config.rl.beta=0.04", "--config.optim.lr=0.01",
           "--config.optim.warmup_steps=0", "--config.lora.rank=4", "--config.lora.layers=1", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=cpu_env())
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _adapters_at(run_dir, step, model_dir):
    from sem_jax.model.hf_io import read_config
    cfg = read_config(str(model_dir))
    like = jax.eval_shape(lambda: lora.init_adapters(lora.LoraSpec(4, 32.0, tuple(lora.TARGETS), 1, 2), cfg))
    params, _ = Checkpointer(os.path.join(run_dir, "ckpt"), read_only=True).restore_params(step, like)
    return params


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, warm_model):
    run = tmp_path_factory.mktemp("lora") / "run"
    proc = _train(run, warm_model)
    assert "LoRA rank 4, alpha 32 on q,k,v,o,gate,up,down of layers 1-1" in proc.stdout
    return run


def test_a_lora_run_resumes_exactly_and_refuses_another_base(lora_run, warm_model, tmp_path):
    b = tmp_path / "b"
    _train(b, warm_model, "--config.train.total_steps=1")
    resumed = _train(b, warm_model)
    assert "resumed from step 1" in resumed.stdout
    two = _adapters_at(lora_run, 2, warm_model)
    for x, y in zip(jax.tree.leaves(two), jax.tree.leaves(_adapters_at(b, 2, warm_model))):
        np.testing.assert_array_equal(x, y)
    # The tiny policy's groups tie at these sizes (no reward signal): AdamW's weight decay moves A alone.
    one = _adapters_at(lora_run, 1, warm_model)
    assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(one), jax.tree.leaves(two)))
    # Another base under the same run (one weight changed): refused by its fingerprint, naming the path.
    import shutil
    from sem_jax.model import from_pretrained, save_pretrained
    other_dir = tmp_path / "other"
    shutil.copytree(warm_model, other_dir)
    other = from_pretrained(str(warm_model))
    other.final_norm[...] = other.final_norm[...].at[0].add(0.5)
    save_pretrained(other, str(other_dir))
    proc = _train(b, other_dir, "--config.train.total_steps=3", check=False)
    assert proc.returncode != 0
    assert "adapters were trained on a base with fingerprint" in proc.stdout + proc.stderr
    assert str(other_dir) in proc.stdout + proc.stderr


def test_a_lora_run_exports_merged_weights_and_peft_adapters(lora_run, warm_model, tmp_path):
    """The merged HF directory, and the PEFT adapters on the base, give transformers the logits
    of the policy sem_jax evaluates (the checkpoint's adapters merged into the base)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from sem_jax.assemble import restore_policy
    from sem_jax.export import export
    from sem_jax.model import from_pretrained
    from sem_jax.settings import run_config

    # The run's adapters have B = 0 (its groups tied); a checkpoint of adapters that change the
    # model, written beside the run's config as training writes it.
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text((lora_run / "config.json").read_text())
    base = from_pretrained(str(warm_model))
    spec = lora.LoraSpec(4, 32.0, tuple(lora.TARGETS), 1, 2)
    trained = jax.tree.map(lambda x: x + 0.02 * jax.random.normal(jax.random.key(0), x.shape),
                           lora.init_adapters(spec, base.config))
    ckpt = Checkpointer(str(run / "ckpt"), async_save=False)
    ckpt.save(2, trained, {"count": jnp.zeros(())}, {"step": 2, "lora_base": lora.fingerprint(nnx.split(base)[1])})
    ckpt.close()
    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapters"
    assert export(str(run / "ckpt"), str(merged_dir), dtype="float32") == 2
    assert export(str(run / "ckpt"), str(adapter_dir), adapters=True) == 2
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["layers_to_transform"]) == (4, 32.0, [1])
    ours = from_pretrained(str(warm_model))
    restore_policy(run_config(str(run), ""), Checkpointer(str(run / "ckpt"), read_only=True), None, ours)
    ids = np.random.RandomState(0).randint(0, ours.config.vocab_size, (2, 12))
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(str(merged_dir)).eval()(torch.tensor(ids)).logits.numpy()
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(str(warm_model)).eval()
        plain = hf_base(torch.tensor(ids)).logits.numpy()
        adapted = peft.PeftModel.from_pretrained(hf_base, str(adapter_dir)).eval()(torch.tensor(ids)).logits.numpy()
    assert np.abs(plain - want).max() > 1e-4  # the adapters changed the model
    np.testing.assert_allclose(adapted, want, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(ids))), want, atol=1e-4)


def test_restoring_adapters_onto_another_base_is_refused(lora_run):
    from sem_jax.assemble import new_model, restore_policy
    from sem_jax.model.hf_io import read_config
    from sem_jax.settings import run_config
    cfg = run_config(str(lora_run), "")
    other = new_model(cfg, read_config(cfg.model.path), jnp.float32, seed=3)
    with pytest.raises(Refused, match="fingerprint"):
        restore_policy(cfg, Checkpointer(os.path.join(lora_run, "ckpt"), read_only=True), None, other)


def test_export_never_replaces_the_base_model_it_reads(lora_run, warm_model):
    from sem_jax.export import export
    before = {p.name: p.stat().st_mtime_ns for p in warm_model.iterdir()}
    with pytest.raises(Refused, match=f"is {warm_model}, which this job reads"):
        export(os.path.join(lora_run, "ckpt"), str(warm_model), overwrite=True)
    assert {p.name: p.stat().st_mtime_ns for p in warm_model.iterdir()} == before
