"""Export a sem_jax checkpoint as a Hugging Face model directory.

    python -m sem_jax.export --checkpoint runs/gpu/ckpt [--step N] --out exported/ [--dtype bfloat16]

Restores parameters only (no optimizer state is read), using the run's resolved
config.json (written by training beside ckpt/), and writes weights, config,
generation config, tokenizer files and chat template that `transformers` loads.
On a multi-host run every process gathers each tensor in turn and process 0 writes.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
from absl import app, flags
from absl import logging as absl_logging
from flax import nnx
from ml_collections import ConfigDict

from sem_jax.checkpoint import Checkpointer
from sem_jax.assemble import init_model_config
from sem_jax.model import Qwen2, save_pretrained
from sem_jax.model.hf_io import read_config
from sem_jax.model.tokenizer import load_tokenizer

def define_flags():
    """Flags exist only when run as a program (importing this module registers none)."""
    flags.DEFINE_string("checkpoint", None, "run_dir/ckpt of a sem_jax run", required=True)
    flags.DEFINE_integer("step", None, "checkpoint step (default: latest)")
    flags.DEFINE_string("out", None, "output directory", required=True)
    flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32", "float16"], "dtype of the written weights")
    flags.DEFINE_string("max_shard_size", "5GB", "split the safetensors above this size")


FLAGS = flags.FLAGS


def run_config(checkpoint: str) -> tuple[ConfigDict, str]:
    run_dir = os.path.dirname(os.path.abspath(checkpoint.rstrip("/")))
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: not found; export reads the run's resolved config beside ckpt/")
    with open(path) as fh:
        return ConfigDict(json.load(fh)), run_dir


def export(checkpoint: str, out: str, *, step: int | None = None, dtype: str = "bfloat16",
           max_shard_size: str = "5GB") -> int:
    """Write the HF directory; returns the exported step."""
    config, run_dir = run_config(checkpoint)
    m = config.model
    if m.path:
        model_cfg = read_config(m.path)
        tok_dir = m.tokenizer or m.path
    else:
        tok_dir = os.path.join(run_dir, "tokenizer")
        model_cfg = init_model_config(config, load_tokenizer(tok_dir))
    model = nnx.eval_shape(lambda: Qwen2(model_cfg, rngs=nnx.Rngs(0), param_dtype=jnp.dtype(m.dtype)))
    _, abstract = nnx.split(model)
    params, got = Checkpointer(checkpoint).restore_params(step, abstract)
    nnx.update(model, params)
    save_pretrained(model, out, dtype=jnp.dtype(dtype), max_shard_size=max_shard_size)
    if jax.process_index() == 0:
        load_tokenizer(tok_dir).save_pretrained(out)
    return got


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)
    got = export(FLAGS.checkpoint, FLAGS.out, step=FLAGS.step, dtype=FLAGS.dtype,
                 max_shard_size=FLAGS.max_shard_size)
    print(f"exported step {got} of {FLAGS.checkpoint} to {FLAGS.out} ({FLAGS.dtype})")


if __name__ == "__main__":
    define_flags()
    app.run(main)
