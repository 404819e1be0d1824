"""Architectures of the Qwen2.5 and Qwen3 checkpoints the configs name, so that compile-only checks
(`sem_jax.aot`) need no weights. Values from the models' config.json files."""

from sem_jax.model.architecture import Qwen2Config

_COMMON = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645)


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tied: bool) -> Qwen2Config:
    """A dense Qwen3 (its config.json's fields beside these are the same for every size)."""
    return Qwen2Config(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
                       num_heads=heads, num_kv_heads=8, head_dim=128, tie_word_embeddings=tied,
                       max_position_embeddings=40960, model_type="qwen3", **_COMMON)


PRESETS: dict[str, Qwen2Config] = {
    "qwen2.5-0.5b": Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                                num_heads=14, num_kv_heads=2, tie_word_embeddings=True, **_COMMON),
    "qwen2.5-1.5b": Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                                num_heads=12, num_kv_heads=2, tie_word_embeddings=True, **_COMMON),
    "qwen2.5-7b": Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                              num_heads=28, num_kv_heads=4, tie_word_embeddings=False, **_COMMON),
    "qwen2.5-14b": Qwen2Config(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_layers=48,
                               num_heads=40, num_kv_heads=8, tie_word_embeddings=False, **_COMMON),
    # Qwen3: 8 KV heads of 128 everywhere (apart from hidden / heads for 0.6B).
    **{f"qwen3-{size}": _qwen3(*dims) for size, dims in {
        "0.6b": (1024, 3072, 28, 16, True), "1.7b": (2048, 6144, 28, 16, True), "4b": (2560, 9728, 36, 32, True),
        "8b": (4096, 12288, 36, 32, False), "14b": (5120, 17408, 40, 40, False)}.items()},
}


def preset(name: str) -> Qwen2Config:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]
