"""The format warm start: supervised traces of the protocol before GRPO.

    python -m sem_jax.sft --config configs/real_cpu.py --out DIR [--overwrite]
    python -m sem_jax.train --config configs/real_cpu.py --config.model.path=DIR

An instruct model that seldom writes SEM's format gives GRPO groups whose rewards all tie (no
signal). This stage trains it on traces built from the config's training questions
(`sem_jax.traces`, `config.sft`): cross-entropy on the model's own tokens only; the inserted
result blocks are context without loss, exactly as in GRPO. It runs the training update itself
(`Trainer(objective="nll")`) on the config's mesh, evaluates the held-out questions before
and after, and writes a Hugging Face directory (with `sem_jax_sft.json`, its report) whole or
not at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from absl import logging as absl_logging
from flax import nnx
from jax.sharding import Mesh
from ml_collections import config_flags

from sem_jax.assemble import build_warm_start
from sem_jax.config import parse_flags
from sem_jax.distributed import initialize as initialize_distributed
from sem_jax.errors import exit_on_error
from sem_jax.policy_eval import policy_scores, top_reasons
from sem_jax.export import check_out_dir, write_hf_dir
from sem_jax.model import lora as lora_lib
from sem_jax.model.qwen2 import Qwen2
from sem_jax.rl.loss import GRPOConfig
from sem_jax.rl.trainer import OptimConfig, Trainer
from sem_jax.sampling.sampler import bucket_length
from sem_jax.config import Config, load
from sem_jax.sharding import replicate
from sem_jax.traces import Pair, build_traces


def pack(pairs: Sequence[Pair], width: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Pairs packed first-fit, in order, into rows of `width` next-token slots: inputs,
    targets, loss mask (trained response segments) and segment ids (1, 2, ... per pair in a
    row; 0 is padding), so that no pair sees another (`Qwen2.hidden_states(segment_ids=)`)."""
    rows: list[list[tuple[list[int], list[int]]]] = [[]]
    used = 0
    for n, (prompt, segments) in enumerate(pairs):
        ids, mask = list(prompt), [0] * len(prompt)
        for seg, trained in segments:
            ids += seg
            mask += [int(trained)] * len(seg)
        if len(ids) - 1 > width:
            raise ValueError(f"pair {n}: {len(ids)} tokens do not fit a packed row of {width} + 1")
        if used + len(ids) - 1 > width:
            rows.append([])
            used = 0
        rows[-1].append((ids, mask))
        used += len(ids) - 1
    out = {"inputs": np.full((len(rows), width), pad_id, np.int32),
           "targets": np.full((len(rows), width), pad_id, np.int32),
           "mask": np.zeros((len(rows), width), np.float32),
           "segment_ids": np.zeros((len(rows), width), np.int32)}
    for r, row in enumerate(rows):
        at = 0
        for k, (ids, mask) in enumerate(row, start=1):
            n = len(ids) - 1
            out["inputs"][r, at:at + n] = ids[:-1]
            out["targets"][r, at:at + n] = ids[1:]
            out["mask"][r, at:at + n] = mask[1:]
            out["segment_ids"][r, at:at + n] = k
            at += n
    return out


def copy_pairs(token_ids: Sequence[int], count: int, seed: int, lengths: tuple[int, int] = (4, 19)) -> list[Pair]:
    """`count` strings of random tokens (`lengths` inclusive), each followed by itself with only
    the repeat trained: the copying ("induction") that pretraining gives a real model and that
    looking something up needs (a name from the question into the query, an answer out of a
    passage). A random-init model learns it here in a few hundred steps, and not from the
    lookup traces in as many."""
    rng = np.random.RandomState(seed)
    ids = np.asarray(token_ids)
    out = []
    for _ in range(count):
        x = ids[rng.randint(len(ids), size=rng.randint(lengths[0], lengths[1] + 1))].tolist()
        out.append(([], [(x, False), (x, True)]))
    return out


def packed_batches(pairs: Sequence[Pair], steps: int, rows: int, width: int, seed: int,
                   pad_id: int = 0):
    """`steps` packed batches of exactly `rows` rows, walking seeded permutations of `pairs`
    (each epoch in a new order; a batch takes pairs until its rows are full)."""
    rng = np.random.RandomState(seed)
    slots = [len(p) + sum(len(s) for s, _ in segs) - 1 for p, segs in pairs]
    order: list[int] = []
    for _ in range(steps):
        taken: list[int] = []
        row, used = 1, 0
        while True:
            if not order:
                order = list(rng.permutation(len(pairs)))
            n = slots[order[0]]
            if used + n > width:
                row, used = row + 1, 0
            if row > rows:
                break
            used += n
            taken.append(order.pop(0))
        batch = pack([pairs[i] for i in taken], width, pad_id)
        pad = rows - len(batch["inputs"])
        yield {k: np.pad(v, ((0, pad), (0, 0)), constant_values=pad_id if k in ("inputs", "targets") else 0)
               for k, v in batch.items()}


def fitting_pairs(pairs: Sequence[Pair], width: int | None) -> list[Pair]:
    """The traces that fit a packed row of `width` (+ 1: inputs and targets are shifted), all when
    `width` is None; those that do not are counted and reported, and refused when none is left
    (found before the first step, not when the packing reaches a long one)."""
    size = lambda pair: len(pair[0]) + sum(len(s) for s, _ in pair[1])
    keep = [pair for pair in pairs if width is None or size(pair) <= width + 1]
    if len(keep) < len(pairs):
        longest = max(size(pair) for pair in pairs)
        if not keep:
            raise ValueError(f"no warm-start trace fits a packed row of sft.width={width} (the longest has {longest} "
                             "tokens): raise sft.width")
        print(f"warm start: skipped {len(pairs) - len(keep)} of {len(pairs)} traces longer than sft.width={width} "
              f"(the longest has {longest} tokens)", flush=True)
    return keep


def supervised_finetune(model: Qwen2, pairs: Sequence[Pair], *, steps: int, lr: float = 3e-3,
                        rows: int = 12, width: int | None = None, seed: int = 0, pad_id: int = 0,
                        log_every: int = 0, micro_batch: int | None = None, weight_decay: float = 0.0,
                        grad_clip: float = 0.0, chunk: int = 128, per_layer: bool | None = None,
                        mesh: Mesh | None = None, lora: lora_lib.LoraSpec | None = None) -> list[float]:
    """Train `model` in place with AdamW (warmup over a tenth of the steps, cosine decay to 0) on
    `pairs`, packed into `rows` x `width` token batches (width: the longest pair, bucketed, at
    least 256) and split into micro-batches of `micro_batch` rows (default: all); `grad_clip` 0
    does not clip. With `mesh`, batches are sharded over its batch axes, each process giving its
    share of the rows. Returns the loss per step (a step whose loss or gradient is not finite is
    not applied, and is reported). `lora`: train adapters on the frozen weights and merge them
    into `model` at the end."""
    _, params = nnx.split(model)
    base = None
    optim = OptimConfig(lr=lr, weight_decay=weight_decay, grad_clip=grad_clip, warmup_steps=max(1, steps // 10),
                        schedule="cosine", total_steps=steps)
    trainer = Trainer(model, GRPOConfig(beta=0.0), optim, micro_batch=micro_batch or rows, logprob_chunk=chunk,
                          per_layer=per_layer, objective="nll", lora=lora)
    if rows % trainer.micro_batch:
        raise ValueError(f"{rows} rows per step do not split into micro-batches of {trainer.micro_batch}")
    pairs = fitting_pairs(pairs, width)
    longest = max(len(p) + sum(len(s) for s, _ in segs) for p, segs in pairs)
    width = width or max(256, bucket_length(longest - 1, minimum=16))
    nproc, pid = jax.process_count(), jax.process_index()
    if rows % nproc:
        raise ValueError(f"{rows} rows per step do not split over {nproc} processes")
    if mesh is None:
        place, on_mesh = jnp.asarray, contextlib.nullcontext()
    else:
        from sem_jax.hosts import to_global
        share = rows // nproc
        place, on_mesh = (lambda v: to_global(v[pid * share:(pid + 1) * share], mesh)), jax.set_mesh(mesh)

    losses, skipped, tokens = [], 0, 0
    t0 = time.perf_counter()
    with on_mesh:  # the model's logical sharding constraints apply under the mesh, as in training
        if lora is not None:
            base = params
            params = lora_lib.init_adapters(lora, model.config, seed)
            if mesh is not None:
                params = replicate(params, mesh)
        opt_state = trainer.init_opt_state(params)
        for i, batch in enumerate(packed_batches(pairs, steps, rows, width, seed, pad_id)):
            params, opt_state, m = trainer.update(params, opt_state, {k: place(v) for k, v in batch.items()},
                                                  base=base)
            losses.append(float(m["loss"]))
            skipped += int(m["skipped"])
            tokens += int((batch["segment_ids"] > 0).sum())
            if log_every and ((i + 1) % log_every == 0 or i + 1 == steps):
                took = time.perf_counter() - t0
                print(f"[warm start {i + 1}/{steps}] loss={np.mean(losses[-log_every:]):.4f} "
                      f"tokens/s={tokens / took:.0f} ({took:.0f}s, about {took / (i + 1) * (steps - i - 1):.0f}s "
                      f"left){f', {skipped} non-finite steps skipped' if skipped else ''}", flush=True)
    if skipped == steps:
        raise FloatingPointError(f"all {steps} warm-start steps had a non-finite loss or gradient; nothing was learnt")
    nnx.update(model, params if lora is None else lora_lib.merge(lora, base, params))
    return losses


# -- the command line's stage ---------------------------------------------------------------

def finetune(config: Config, out: str, *, overwrite: bool = False, dtype: str | None = None) -> dict[str, Any]:
    """The warm start as `config.sft` says, from `config.model.path` to the HF directory `out`;
    returns the report written there (`sem_jax_sft.json`)."""
    f = config.sft
    if not config.model.path:
        raise ValueError("sem_jax.sft warm-starts a pretrained model: set --config.model.path (the demo's "
                         "random-init model has its own warm start, `make demo`)")
    check_out_dir(out, overwrite, sources=[config.model.path])
    t_start = time.perf_counter()
    run = build_warm_start(config)
    model, tokenizer, retriever, mesh = run.model, run.tokenizer, run.retriever, run.mesh
    protocol, system_prompt = config.chat_protocol(), config.prompt()
    pairs, stats = build_traces(run.train_set, tokenizer, retriever, protocol, count=f.traces,
                                search_share=f.search_share, top_k=config.retrieval.top_k,
                                max_tokens_per_passage=config.retrieval.max_tokens_per_passage,
                                system_prompt=system_prompt, seed=config.seed, decision=f.decision)
    print(f"warm start: {stats.summary()}", flush=True)
    report: dict[str, Any] = {"source": os.path.abspath(config.model.path), "traces": stats.__dict__,
                              "sft": dataclasses.asdict(f), "lora": dataclasses.asdict(config.lora),
                              "system_prompt": system_prompt}
    def score(when: str) -> None:  # as training evaluates: every process its share
        report[when] = policy_scores(run.greedy, tokenizer, retriever, run.eval_set, config.engine(),
                                     run.eval_batch, system_prompt, protocol, mesh)
        print(_scores_line(when, report[when], run.eval_total), flush=True)
    if f.eval:
        score("before")
    t_train = time.perf_counter()
    losses = supervised_finetune(model, pairs, steps=f.steps, lr=f.lr, rows=f.rows, width=f.width or None,
                                 seed=config.seed, pad_id=run.pad_id, log_every=max(1, f.steps // 10),
                                 micro_batch=f.micro_batch or None, weight_decay=f.weight_decay,
                                 grad_clip=f.grad_clip, chunk=config.rl.logprob_chunk, mesh=mesh,
                                 lora=lora_lib.spec_of(config.lora, model.config))
    report.update(losses=[round(x, 5) for x in losses], train_seconds=round(time.perf_counter() - t_train, 1))
    if f.eval:
        run.greedy.set_params(nnx.split(model)[1])
        score("after")
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    write_hf_dir(model, tokenizer, out, dtype=dtype, overwrite=overwrite, extra={"sem_jax_sft.json": report})
    print(f"wrote {out} ({report['seconds']:.0f}s); train on it with --config.model.path={out}", flush=True)
    return report


def _scores_line(when: str, m: dict[str, float], n: int) -> str:
    reasons = top_reasons(m, 3)
    split = "".join(f", {label} {100 * m[f'search_ratio/{label}']:.0f}%" for label in ("known", "unknown")
                    if f"search_ratio/{label}" in m)
    return (f"{when} the warm start, {n} held-out questions: valid {100 * m['valid']:.0f}%, EM {100 * m['em']:.1f}, "
            f"search ratio {100 * m['search_ratio']:.0f}%{split}" + (f"; invalid: {reasons}" if reasons else ""))


def define_flags():
    """Flags exist only when run as a program (importing this module registers none)."""
    global _CONFIG
    _CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file (ml_collections).",
                                              lock_config=True)
    flags.DEFINE_string("out", None, "output directory (a Hugging Face model)", required=True)
    flags.DEFINE_bool("overwrite", False, "replace a non-empty --out")
    flags.DEFINE_enum("dtype", None, ["bfloat16", "float32", "float16"], "dtype of the written weights "
                      "(default: model.dtype)")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CONFIG.value is None:
        raise app.UsageError("--config is required (the model, data and sft settings)")
    absl_logging.set_verbosity(absl_logging.WARNING)
    config = load(_CONFIG.value)
    initialize_distributed(config.distributed)
    finetune(config, flags.FLAGS.out, overwrite=flags.FLAGS.overwrite, dtype=flags.FLAGS.dtype)


if __name__ == "__main__":
    define_flags()
    app.run(lambda argv: exit_on_error(lambda: main(argv)), flags_parser=parse_flags)
