"""Building the policy, tokenizer and retriever from a config (shared by train, evaluate, export)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from ml_collections import ConfigDict

from sem_jax.model import Qwen2, Qwen2Config, from_pretrained
from sem_jax.model.tokenizer import load_tokenizer, train_bpe_tokenizer


def init_model_config(config: ConfigDict, tokenizer) -> Qwen2Config:
    """The random-init architecture of `config.model.init` (vocabulary padded to 64)."""
    i = config.model.init
    return Qwen2Config(vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=i.hidden_size,
                       intermediate_size=i.intermediate_size, num_layers=i.num_layers, num_heads=i.num_heads,
                       num_kv_heads=i.num_kv_heads, rope_theta=i.rope_theta,
                       tie_word_embeddings=i.tie_word_embeddings, bos_token_id=None,
                       eos_token_id=tokenizer.eos_token_id)


def build_policy(config: ConfigDict, texts: Callable[[], list[str]] | None, run_dir: str,
                 mesh: Mesh | None = None) -> tuple[Qwen2, Any]:
    """The policy and its tokenizer: a local HF directory (weights streamed straight into their
    shardings on `mesh`), or (no path) a random tiny model with a small BPE trained on
    `texts()` (saved to run_dir/tokenizer, reused on resume)."""
    m = config.model
    dtype, compute = jnp.dtype(m.dtype), jnp.dtype(m.compute_dtype)
    if m.path:
        tokenizer = load_tokenizer(m.tokenizer or m.path)
        model = from_pretrained(m.path, dtype=dtype, compute_dtype=compute, remat=m.remat, mesh=mesh)
        return model, tokenizer
    tok_dir = os.path.join(run_dir, "tokenizer")
    if os.path.exists(os.path.join(tok_dir, "tokenizer.json")):  # resumed run: the same tokenizer
        tokenizer = load_tokenizer(tok_dir)
    else:
        if texts is None:
            raise FileNotFoundError(f"{tok_dir}: no tokenizer.json (was this run trained with model.path unset?)")
        tokenizer = train_bpe_tokenizer(texts(), m.init.tokenizer_vocab)
        if jax.process_index() == 0:
            tokenizer.save_pretrained(tok_dir)
    model = Qwen2(init_model_config(config, tokenizer), rngs=nnx.Rngs(config.seed), param_dtype=dtype,
                  dtype=compute, remat=m.remat)
    return model, tokenizer


def build_retriever(config: ConfigDict):
    from sem_jax.retrieval import Retriever
    r = config.retrieval
    if r.index_dir:
        return Retriever.load(r.index_dir)
    return Retriever.from_jsonl(r.corpus, show_progress=False)
