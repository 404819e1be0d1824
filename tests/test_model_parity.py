"""The Flax model against Hugging Face `Qwen2ForCausalLM` and `Qwen3ForCausalLM` (torch, f32)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import torch_logits, write_hf_qwen2, write_hf_qwen3

from sem_jax.model import from_pretrained, save_pretrained
from sem_jax.model.safetensors_io import SafetensorsFile

CONFIGS = {
    # 6 query heads over 2 KV heads, untied, forced into several shards.
    "untied_gqa_sharded": dict(max_shard_size="60KB"),
    # Tied embeddings, odd widths: 5 heads of 8, 1 KV head, 2 layers.
    "tied_odd": dict(vocab_size=203, hidden_size=40, intermediate_size=72, num_hidden_layers=2,
                     num_attention_heads=5, num_key_value_heads=1, tie_word_embeddings=True,
                     rope_theta=10000.0),
    # Qwen3: per-head q/k norms, no biases, head_dim 16 apart from hidden / heads = 8; sharded.
    "qwen3_untied_gqa_sharded": dict(family="Qwen3", head_dim=16, max_shard_size="60KB"),
    # Qwen3 tied, odd widths, head_dim 6 over hidden 40 / 5 heads = 8.
    "qwen3_tied_odd": dict(family="Qwen3", vocab_size=203, hidden_size=40, intermediate_size=72,
                           num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=1, head_dim=6,
                           tie_word_embeddings=True, rope_theta=10000.0),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = write_hf_qwen2(path, **CONFIGS[request.param])
    if "max_shard_size" in CONFIGS[request.param]:
        assert os.path.exists(path / "model.safetensors.index.json")
    return path, model


def test_logits_match_transformers(hf_model):
    path, ref = hf_model
    model = from_pretrained(str(path))
    tokens = np.random.RandomState(1).randint(0, model.config.vocab_size, (3, 29))
    ours = np.asarray(model(jnp.asarray(tokens)))
    want = torch_logits(ref, tokens)
    assert ours.shape == want.shape == (3, 29, model.config.vocab_size)
    diff = np.abs(ours - want).max()
    print(f"max |logit diff| vs transformers ({path.name}): {diff:.3g}")
    assert diff <= 1e-4


def test_sharded_checkpoint_is_sharded(tmp_path):
    write_hf_qwen2(tmp_path, max_shard_size="60KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert from_pretrained(str(tmp_path)).config.num_layers == 3


def test_round_trip_bit_identical_and_loadable(hf_model, tmp_path):
    import transformers

    path, ref = hf_model
    model = from_pretrained(str(path))
    names = save_pretrained(model, str(tmp_path), max_shard_size="50KB")
    assert len(names) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    # Every tensor bit-identical to what transformers wrote.
    src = {n: p.detach().numpy() for n, p in ref.state_dict().items()}
    if ref.config.tie_word_embeddings:
        src.pop("lm_head.weight")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(src)
    for name, fname in index.items():
        got = SafetensorsFile(str(tmp_path / fname))[name]
        assert got.dtype == np.float32 and np.array_equal(got, src[name]), name
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(again) is type(ref)
    tokens = np.random.RandomState(2).randint(0, model.config.vocab_size, (2, 11))
    np.testing.assert_array_equal(torch_logits(again, tokens), torch_logits(ref, tokens))


def test_bf16_export_loads_in_transformers(tmp_path):
    import torch
    import transformers

    write_hf_qwen2(tmp_path / "src")
    model = from_pretrained(str(tmp_path / "src"))
    save_pretrained(model, str(tmp_path / "out"), dtype=jnp.bfloat16)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16"
    loaded = transformers.Qwen2ForCausalLM.from_pretrained(str(tmp_path / "out"))
    w = loaded.model.layers[1].self_attn.q_proj.weight
    assert w.dtype == torch.bfloat16
    want = np.asarray(model.layers["q_kernel"][1]).reshape(48, -1).T
    np.testing.assert_array_equal(w.detach().float().numpy(), want.astype(jnp.bfloat16).astype(np.float32))


def test_bf16_load_and_compute(tmp_path):
    ref = write_hf_qwen2(tmp_path)
    model = from_pretrained(str(tmp_path), dtype=jnp.bfloat16)
    assert model.embed[...].dtype == jnp.bfloat16
    tokens = np.random.RandomState(3).randint(0, 320, (2, 9))
    ours = np.asarray(model(jnp.asarray(tokens)))
    assert ours.dtype == np.float32
    # bf16 end to end: close to f32 in relative terms, not equal.
    want = torch_logits(ref, tokens)
    assert np.abs(ours - want).max() / np.abs(want).max() < 0.1


def test_remat_gives_same_gradients(tmp_path):
    from flax import nnx

    write_hf_qwen2(tmp_path)
    tokens = jnp.asarray(np.random.RandomState(4).randint(0, 320, (2, 8)))

    def grads(remat):
        model = from_pretrained(str(tmp_path), remat=remat)
        graph, state = nnx.split(model)
        loss = lambda s: nnx.merge(graph, s)(tokens).mean()
        return jax.grad(loss)(state)

    base = grads("none")
    for policy in ("full", "dots"):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), base, grads(policy))


def test_errors_name_file_and_tensor(tmp_path):
    write_hf_qwen2(tmp_path / "ok")
    # Missing tensor.
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(tmp_path / "ok" / "model.safetensors"))
    bad = tmp_path / "missing"
    bad.mkdir()
    (bad / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"},
              str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        from_pretrained(str(bad))
    # Wrong shape.
    tensors["model.layers.0.self_attn.k_proj.bias"] = np.zeros(7, np.float32)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing/model\.safetensors.*k_proj\.bias.*\(7,\)"):
        from_pretrained(str(bad))
    # Unsupported architecture.
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json.*unsupported architecture.*Llama"):
        from_pretrained(str(bad))
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained(str(tmp_path / "nowhere"))


def test_a_truncated_checkpoint_is_refused_naming_the_tensor_and_bytes(tmp_path):
    write_hf_qwen2(tmp_path / "ok")
    path = tmp_path / "ok" / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 1000])  # an interrupted copy
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated: tensor '[^']+' needs bytes \d+\.\.\d+ of the "
                                         rf"file, which has {len(data) - 1000} \(\d+ missing\)"):
        from_pretrained(str(tmp_path / "ok"))


def test_qwen3_greedy_sampler_equals_hf_generate(tmp_path):
    """Greedy decoding of a ragged batch through the sampler (prefill, cache, decode steps, in the
    stacked layout that TPUs run; CPUs' per-layer one runs in test_qwen3_pipeline's evaluation)
    gives transformers' `generate` tokens on a Qwen3."""
    import torch

    from sem_jax.sampling import Sampler, SamplingConfig, stop_automaton_from_bytes

    ref = write_hf_qwen3(tmp_path, head_dim=16)
    model = from_pretrained(str(tmp_path))
    assert model.config.model_type == "qwen3" and model.config.head_dim == 16
    never = stop_automaton_from_bytes([bytes([97 + i % 26]) for i in range(320)], ("</search>",))
    prompts = [[5, 17, 42], [9, 1, 2, 3, 4, 5, 6, 7, 8, 100], [33]]
    new = 20
    sampler = Sampler(model, never, SamplingConfig(max_new_tokens=new, greedy=True), per_layer=False)
    state = sampler.decode(sampler.start(prompts, 1, jax.random.key(0)))
    resp = np.asarray(state.resp)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               pad_token_id=0)
        assert resp[i].tolist() == out[0, len(p):].tolist(), i


def test_qwen3_errors_name_file_and_tensor(tmp_path):
    """A Qwen3 without a head norm, with attention biases, or a Qwen3 MoE: refused by name."""
    from safetensors.numpy import load_file, save_file

    write_hf_qwen3(tmp_path / "ok")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    tensors = load_file(str(tmp_path / "ok" / "model.safetensors"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in tensors.items() if k != "model.layers.2.self_attn.k_norm.weight"},
              str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"model\.layers\.2\.self_attn\.k_norm\.weight"):
        from_pretrained(str(bad))
    for change, message in ((dict(attention_bias=True), "attention_bias=true is not supported for Qwen3"),
                            (dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe"),
                             "unsupported architecture.*Qwen3Moe"),
                            (dict(model_type="qwen2"), r"unsupported architecture \['Qwen3ForCausalLM'\]")):
        (bad / "config.json").write_text(json.dumps(dict(cfg, **change)))
        with pytest.raises(ValueError, match=r"bad/config\.json: " + message):
            from_pretrained(str(bad))
