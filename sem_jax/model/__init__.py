"""The Qwen2-family model, its Hugging Face I/O and tokenizers."""

from sem_jax.model.architecture import Qwen2Config
from sem_jax.model.hf_io import from_pretrained, save_pretrained
from sem_jax.model.qwen2 import KVCache, Qwen2, param_shapes

__all__ = ["KVCache", "Qwen2", "Qwen2Config", "from_pretrained", "param_shapes", "save_pretrained"]
