"""Architectures of the Qwen2.5 checkpoints the configs name, so that compile-only checks
(`sem_jax.aot`) need no weights. Values from the models' config.json files."""

from sem_jax.model.config import Qwen2Config

_COMMON = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645)

PRESETS: dict[str, Qwen2Config] = {
    "qwen2.5-0.5b": Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                                num_heads=14, num_kv_heads=2, tie_word_embeddings=True, **_COMMON),
    "qwen2.5-1.5b": Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                                num_heads=12, num_kv_heads=2, tie_word_embeddings=True, **_COMMON),
    "qwen2.5-7b": Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                              num_heads=28, num_kv_heads=4, tie_word_embeddings=False, **_COMMON),
    "qwen2.5-14b": Qwen2Config(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_layers=48,
                               num_heads=40, num_kv_heads=8, tie_word_embeddings=False, **_COMMON),
}


def preset(name: str) -> Qwen2Config:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]
