"""Test setup: CPU only, 8 simulated devices, exact f32 matmuls; shared fixtures."""

import os

# Before jax is imported anywhere: 8 host devices for the multi-device tests, and
# never try an accelerator (libtpu prints errors on a CPU host when jax[tpu] is in).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def write_hf_qwen2(path, *, seed=0, max_shard_size="5GB", dtype="float32", **overrides):
    """Random-weight Qwen2 written by `transformers` itself; returns the torch model (eval)."""
    import torch
    import transformers

    kw = dict(vocab_size=320, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
              num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False,
              rope_theta=1e6, max_position_embeddings=256, rms_norm_eps=1e-6)
    kw.update(overrides)
    cfg = transformers.Qwen2Config(**kw)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    # HF initialises biases to 0 and norms to 1; randomise everything so that a
    # wrong bias, norm or transpose cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(str(path), max_shard_size=max_shard_size)
    return model


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


@pytest.fixture(scope="session")
def qwen25_tokenizer():
    from sem_jax.model.tokenizer import build_qwen25_tokenizer
    return build_qwen25_tokenizer()
