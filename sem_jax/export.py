"""Export a sem_jax checkpoint as a Hugging Face model directory.

    python -m sem_jax.export --checkpoint runs/gpu/ckpt [--step N] --out exported/ [--dtype bfloat16] [--overwrite]
    python -m sem_jax.export --checkpoint runs/lora/ckpt --out adapters/ --adapters   # a LoRA run's, for PEFT

Restores parameters only (no optimizer state is read), using the run's resolved
config.json (written by training beside ckpt/); a LoRA run's adapters are merged into the base
they were trained on (its `model.path`), or with --adapters written alone in PEFT's layout
(`adapter_config.json`, `adapter_model.safetensors`) for `PeftModel.from_pretrained(base, out)`.
The HF directory holds weights, config,
generation config, tokenizer files and chat template that `transformers` loads, as a
new directory renamed into place (a non-empty --out is replaced only with --overwrite).
On a multi-host run every process gathers each tensor in turn and process 0 writes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import app, flags
from absl import logging as absl_logging
from flax import nnx
from safetensors.numpy import save_file

from sem_jax.checkpoint import Checkpointer, checkpoint_run_dir
from sem_jax.errors import Refused, exit_on_error
from sem_jax.assemble import build_policy, init_model_config, restore_policy
from sem_jax.model import Qwen2, save_pretrained
from sem_jax.model import lora as lora_lib
from sem_jax.model.hf_io import read_config
from sem_jax.model.tokenizer import load_tokenizer, save_tokenizer
from sem_jax.config import Config
from sem_jax.config import run_config as settings_of_run
from sem_jax.whole_dir import writing


def define_flags():
    """Flags exist only when run as a program (importing this module registers none)."""
    flags.DEFINE_string("checkpoint", None, "run_dir/ckpt of a sem_jax run", required=True)
    flags.DEFINE_integer("step", None, "checkpoint step (default: latest)")
    flags.DEFINE_string("out", None, "output directory", required=True)
    flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32", "float16"], "dtype of the written weights")
    flags.DEFINE_string("max_shard_size", "5GB", "split the safetensors above this size")
    flags.DEFINE_bool("overwrite", False, "replace a non-empty --out")
    flags.DEFINE_bool("adapters", False, "a LoRA run: write its adapters alone, in PEFT's layout")


FLAGS = flags.FLAGS


def run_config(checkpoint: str) -> tuple[Config, str]:
    run_dir = checkpoint_run_dir(checkpoint)
    return settings_of_run(run_dir, "export reads the run's resolved config beside ckpt/"), run_dir


def _within(path: str, parent: str) -> bool:
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


def check_out_dir(out: str, overwrite: bool, sources: Sequence[str] = ()) -> None:
    """Refuse an `out` that is a file, or a non-empty directory unless `overwrite`, or (whatever
    the flags) one that holds, is, or lies inside a `source` the job reads (the run directory of
    the checkpoint, the model): replacing it would delete what is being exported. Checked before
    any work, so that a long job does not fail at its last step."""
    for source in sources:
        if _within(source, out) or _within(out, source):
            how = "is" if _within(out, source) and _within(source, out) else \
                "holds" if _within(source, out) else "lies inside"
            raise Refused(f"--out={out}: {how} {source}, which this "
                          "job reads; writing there would replace it. Choose an --out outside it")
    if os.path.isfile(out):
        raise FileExistsError(f"{out}: is a file, not a directory")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise FileExistsError(f"{out}: not empty (pass --overwrite to replace it)")


def write_hf_dir(model: Qwen2, tokenizer, out: str, *, dtype: Any = None, max_shard_size: str = "5GB",
                 overwrite: bool = False, extra: dict[str, Any] | None = None) -> None:
    """`model` and `tokenizer` as a Hugging Face directory at `out`, whole or not at all: written
    beside it (`out.partial`) and renamed into place, so that no shard or index of an earlier
    model stays beside the new one and an interrupted write leaves `out` as it was. `extra`:
    JSON files to add (name -> object). On a multi-host run every process takes part in the
    gathers and process 0 writes."""
    check_out_dir(out, overwrite)
    save = lambda tmp: save_pretrained(model, tmp, dtype=None if dtype is None else jnp.dtype(dtype),
                                       max_shard_size=max_shard_size)
    if jax.process_index() != 0:
        save(out)  # the other processes take part in the gathers and write nothing
        return
    with writing(out) as tmp:
        save(tmp)
        save_tokenizer(tokenizer, tmp)
        for name, obj in (extra or {}).items():
            with open(os.path.join(tmp, name), "w") as fh:
                json.dump(obj, fh, indent=2)


def export(checkpoint: str, out: str, *, step: int | None = None, dtype: str = "bfloat16",
           max_shard_size: str = "5GB", overwrite: bool = False, adapters: bool = False) -> int:
    """Write the HF directory (or, `adapters`, a LoRA run's PEFT adapter directory); returns the
    exported step."""
    ckpt = Checkpointer(checkpoint, read_only=True)  # a mistyped path fails here, before the model is built
    config, run_dir = run_config(checkpoint)
    m = config.model
    # Neither the run nor the base model and tokenizer it reads may be replaced, --overwrite or not.
    check_out_dir(out, overwrite, sources=[run_dir] + [p for p in (m.path, m.tokenizer) if p])
    if m.path:
        model_cfg = read_config(m.path)
        tok_dir = m.tokenizer or m.path
    else:
        tok_dir = os.path.join(run_dir, "tokenizer")
        model_cfg = init_model_config(config, load_tokenizer(tok_dir))
    spec = lora_lib.spec_of(config.lora, model_cfg)
    if adapters:
        if spec is None:
            raise Refused(f"{checkpoint}: --adapters exports a LoRA run's adapters; this run fine-tuned every weight "
                          "(lora.rank=0): export its merged weights without --adapters")
        return _export_adapters(config, spec, model_cfg, ckpt, step, out)
    if spec is None:
        model = nnx.eval_shape(lambda: Qwen2(model_cfg, rngs=nnx.Rngs(0), param_dtype=jnp.dtype(m.dtype)))
        _, abstract = nnx.split(model)
        params, got = ckpt.restore_params(step, abstract)
        nnx.update(model, params)
    else:  # the base the run trained on, the adapters merged in
        model, _ = build_policy(config, None, run_dir)
        got = restore_policy(config, ckpt, step, model)
    write_hf_dir(model, load_tokenizer(tok_dir), out, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite)
    return got


def _export_adapters(config: Config, spec: lora_lib.LoraSpec, model_cfg: Any, ckpt: Checkpointer, step: int | None,
                     out: str) -> int:
    """A LoRA run's adapters in PEFT's layout at `out`, written beside it and renamed into place."""
    adapters, got = ckpt.restore_params(step, lora_lib.abstract_adapters(spec, model_cfg))
    if jax.process_index() != 0:
        return got
    with writing(out) as tmp:
        save_file(lora_lib.peft_tensors(spec, adapters), os.path.join(tmp, "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(tmp, "adapter_config.json"), "w") as fh:
            json.dump(lora_lib.peft_config(spec, config.model.path and os.path.abspath(config.model.path)), fh,
                      indent=2)
    return got


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)
    got = export(FLAGS.checkpoint, FLAGS.out, step=FLAGS.step, dtype=FLAGS.dtype,
                 max_shard_size=FLAGS.max_shard_size, overwrite=FLAGS.overwrite, adapters=FLAGS.adapters)
    print(f"exported step {got} of {FLAGS.checkpoint} to {FLAGS.out} ({FLAGS.dtype})")


if __name__ == "__main__":
    define_flags()
    app.run(lambda argv: exit_on_error(lambda: main(argv)))
