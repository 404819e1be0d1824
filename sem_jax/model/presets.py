"""Architectures of the Qwen2.5 and Qwen3 checkpoints the configs name, so that compile-only checks
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
    # Qwen3: head_dim 128 everywhere (apart from hidden / heads for 0.6B), 8 KV heads.
    "qwen3-0.6b": Qwen2Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                              num_heads=16, num_kv_heads=8, head_dim=128, tie_word_embeddings=True,
                              max_position_embeddings=40960, model_type="qwen3", **_COMMON),
    "qwen3-1.7b": Qwen2Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28,
                              num_heads=16, num_kv_heads=8, head_dim=128, tie_word_embeddings=True,
                              max_position_embeddings=40960, model_type="qwen3", **_COMMON),
    "qwen3-4b": Qwen2Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_layers=36,
                            num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=True,
                            max_position_embeddings=40960, model_type="qwen3", **_COMMON),
    "qwen3-8b": Qwen2Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                            num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=False,
                            max_position_embeddings=40960, model_type="qwen3", **_COMMON),
    "qwen3-14b": Qwen2Config(vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_layers=40,
                             num_heads=40, num_kv_heads=8, head_dim=128, tie_word_embeddings=False,
                             max_position_embeddings=40960, model_type="qwen3", **_COMMON),
}


def preset(name: str) -> Qwen2Config:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]
