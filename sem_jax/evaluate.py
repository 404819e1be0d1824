"""Evaluation tables in the layout of the paper's Tables 1 and 2.

    python -m sem_jax.evaluate --config configs/gpu.py --checkpoint runs/gpu/ckpt \
        --data hotpotqa=/data/hotpot_dev.json,musique=/data/musique_dev.jsonl,mmlu=cais/mmlu,gsm8k=/data/gsm8k_test.jsonl \
        --limit 500 --seed 0 --modes policy,direct,naive_rag --out runs/gpu/eval

Modes: `policy` (the SEM prompt, searches answered), `direct` (no search offered),
`naive_rag` (retrieve once with the question, passages in the prompt, then answer).
Greedy decoding, one trajectory per question. Writes results.md, results.json,
per-question predictions_<mode>_<dataset>.jsonl and, with --limit, the sampled ids
(sample_<dataset>.json).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence

import jax
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from sem_jax.assemble import build_evaluation
from sem_jax.checkpoint import checkpoint_run_dir
from sem_jax.config import parse_flags
from sem_jax.data.example import Example
from sem_jax.data.mix import stratified_sample
from sem_jax.data.questions import load_questions
from sem_jax.data.sources import load_source
from sem_jax.distributed import initialize as initialize_distributed
from sem_jax.errors import exit_on_error
from sem_jax.policy_eval import MODES, aggregate, all_records, run_mode
from sem_jax.protocol import SEM, Protocol
from sem_jax.sampling import RolloutConfig
from sem_jax.config import load
from sem_jax.config import run_config as settings_of_run

def results_table(results: dict[str, dict[str, dict[str, float]]], datasets: Sequence[str]) -> str:
    """Markdown: one row per mode, EM / F1 / SR (%) per data set, as the paper's tables."""
    head = "| method | " + " | ".join(f"{d} EM | {d} F1 | {d} SR" for d in datasets) + " |"
    sep = "|---" * (1 + 3 * len(datasets)) + "|"
    rows = [head, sep]
    for mode, per in results.items():
        cells = []
        for d in datasets:
            m = per.get(d)
            cells += ["-"] * 3 if m is None else [f"{100 * m['em']:.2f}", f"{100 * m['f1']:.2f}",
                                                   f"{100 * m['search_ratio']:.2f}"]
        rows.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def evaluate_modes(sampler, tokenizer, retriever, data: dict[str, list[Example]], modes: Sequence[str],
                   cfg: RolloutConfig, batch_size: int, out_dir: str | None = None,
                   system_prompt: str | None = None, protocol: Protocol = SEM, mesh=None) -> dict:
    """Scores per mode and data set. With `mesh`, every process scores its share of each data set
    (`batch_size` rows per process at a time) and all get every record; only `out_dir`'s owner
    (process 0: the others pass None) writes."""
    results: dict[str, dict[str, dict[str, float]]] = {}
    for mode in modes:
        results[mode] = {}
        for name, examples in data.items():
            if mesh is None:
                records = run_mode(mode, sampler, tokenizer, retriever, examples, cfg, batch_size, system_prompt,
                                   protocol)
            else:
                records = all_records(mode, sampler, tokenizer, retriever, examples, cfg, batch_size, system_prompt,
                                      protocol, mesh)
            results[mode][name] = aggregate(records)
            if out_dir:
                with open(os.path.join(out_dir, f"predictions_{mode}_{name}.jsonl"), "w") as fh:
                    for r in records:
                        fh.write(json.dumps(r) + "\n")
            m = results[mode][name]
            if jax.process_index() == 0:
                print(f"[eval] {mode:9s} {name:9s} EM {100 * m['em']:6.2f}  SR {100 * m['search_ratio']:6.2f}  "
                      f"valid {100 * m['valid']:6.2f}  cut {100 * m['length']:6.2f}  ({len(records)} questions)",
                      flush=True)
            if out_dir:  # after every finished part: a later failure loses none of it
                write_results(out_dir, results, list(data))
    return results


def evaluate_run(run, data: dict[str, list[Example]], modes: Sequence[str], out_dir: str | None) -> dict:
    """`evaluate_modes` with a built run's greedy sampler, retriever and mesh, under its config's
    engine, system prompt and protocol."""
    c = run.config
    return evaluate_modes(run.greedy, run.tokenizer, run.retriever, data, modes, c.engine(), batch_size=run.eval_batch,
                          out_dir=out_dir, system_prompt=c.prompt(), protocol=c.chat_protocol(), mesh=run.mesh)


def write_sample(out_dir: str | None, name: str, examples: list[Example], limit: int, seed: int) -> list[Example]:
    """The --limit sample of one data set, its ids and category counts written beside the
    results (sample_<name>.json, unless `out_dir` is None) so that another run can be compared
    on the same questions."""
    chosen = stratified_sample(examples, limit, seed)
    record = {"data set": name, "seed": seed, "limit": limit, "of": len(examples),
              "categories": dict(sorted(Counter(ex.category for ex in chosen).items())),
              "ids": [ex.id for ex in chosen]}
    if out_dir is None:
        return chosen
    with open(os.path.join(out_dir, f"sample_{name}.json"), "w") as fh:
        json.dump(record, fh, indent=1)
    print(f"{name}: {len(chosen)} of {len(examples)} questions sampled with seed {seed} "
          f"({len(record['categories'])} categories)", flush=True)
    return chosen


def write_results(out_dir: str, results: dict, datasets: Sequence[str]) -> None:
    for name, text in (("results.json", json.dumps(results, indent=2)), ("results.md", results_table(results, datasets))):
        path = os.path.join(out_dir, name)
        with open(path + ".tmp", "w") as fh:
            fh.write(text)
        os.replace(path + ".tmp", path)


# -- command line -------------------------------------------------------------------------

def define_flags():
    """Flags exist only when run as a program (importing this module registers none)."""
    global _CONFIG
    _CONFIG = config_flags.DEFINE_config_file("config", None, "Training config (model, retrieval, rollout); "
                                              "default with --checkpoint: the run's own (run_dir/config.json)")
    flags.DEFINE_string("checkpoint", None, "run_dir/ckpt of a sem_jax run (parameters restored alone)")
    flags.DEFINE_integer("step", None, "checkpoint step (default: latest)")
    flags.DEFINE_string("hf", None, "a Hugging Face model directory instead of a checkpoint")
    flags.DEFINE_string("data", None, "name=path[,name=path...] with name in musique, mmlu, hotpotqa, gsm8k and "
                        "path a local file or directory, or hub_id[:config]; default: the config's eval file")
    flags.DEFINE_integer("limit", None, "questions per data set: a seeded random sample (--seed), stratified by "
                         "category (MMLU's subject, MuSiQue's hop count); the chosen ids go to sample_<name>.json")
    flags.DEFINE_integer("seed", 0, "seed of the --limit sample")
    flags.DEFINE_string("modes", "policy,direct,naive_rag", "comma-separated modes")
    flags.DEFINE_string("out", None, "output directory (default: <run_dir>/eval)")
    flags.DEFINE_string("dtype", None, "parameter dtype (default: the config's model.eval_dtype, else model.dtype)")


FLAGS = flags.FLAGS
EVAL_SPLITS = {"mmlu": "test", "gsm8k": "test"}  # the others: validation (MuSiQue and HotpotQA dev)


def run_config(checkpoint: str):
    """The config a run was trained with (`sem_jax.train` writes run_dir/config.json)."""
    if not os.path.isdir(checkpoint):
        raise app.UsageError(f"{os.path.abspath(checkpoint)}: no checkpoint directory there (a run's is run_dir/ckpt)")
    return settings_of_run(checkpoint_run_dir(checkpoint), "give --config (the model, retrieval and rollout settings)")


def parse_modes(text: str) -> list[str]:
    """--modes: known modes, at least one, each once; refused before anything runs."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes:
        raise app.UsageError(f"--modes={text!r}: no mode given; choose from {', '.join(MODES)}")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise app.UsageError(f"--modes: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(MODES)}")
    if len(set(modes)) < len(modes):
        raise app.UsageError(f"--modes={text!r}: a mode given twice")
    return modes


def parse_data(text: str) -> dict[str, str]:
    """--data name=path[,name=path...]: each name once (two paths for one name would overwrite
    each other's results), each with a path."""
    data: dict[str, str] = {}
    for item in text.split(","):
        name, eq, path = (x.strip() for x in item.partition("="))
        if not (name and eq and path):
            raise app.UsageError(f"--data: {item!r} is not name=path")
        if name in data:
            raise app.UsageError(f"--data: {name!r} given twice ({data[name]!r} and {path!r}); one path per data set")
        data[name] = path
    return data


def output_dir(out: str | None, checkpoint: str | None, config) -> str:
    """--out, else `eval` beside the checkpoint (run_dir/ckpt -> run_dir/eval: a copied run writes
    into the copy, not into the run_dir its config.json names), else the config's run_dir/eval."""
    if out:
        return out
    return os.path.join(checkpoint_run_dir(checkpoint) if checkpoint else config.run_dir, "eval")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)
    if FLAGS.limit is not None and FLAGS.limit < 1:
        raise app.UsageError(f"--limit={FLAGS.limit}: give at least 1 question per data set (or leave it out: all)")
    modes = parse_modes(FLAGS.modes)
    sources = parse_data(FLAGS.data) if FLAGS.data else None
    if _CONFIG.value is not None:
        config = load(_CONFIG.value)
    elif FLAGS.checkpoint:
        config = run_config(FLAGS.checkpoint)
    else:
        raise app.UsageError("--config is required (the model, retrieval and rollout settings)")
    if FLAGS.dtype:
        config = config.replace(**{"model.eval_dtype": FLAGS.dtype})
    initialize_distributed(config.distributed)  # first: before anything starts a backend
    run = build_evaluation(config, checkpoint=FLAGS.checkpoint, step=FLAGS.step, hf=FLAGS.hf)
    if sources:  # every process reads every data set and draws the same sample
        # The split each data set is evaluated on (a local file is read whole).
        data = {name: load_source(name, path, split=EVAL_SPLITS.get(name, "validation"))
                for name, path in sources.items()}
    else:
        data = {"eval": load_questions(config.data.eval_file)}
    data = {name: run.cap(examples, name) for name, examples in data.items()}
    out = output_dir(FLAGS.out, FLAGS.checkpoint, config)
    writer = jax.process_index() == 0
    if writer:
        os.makedirs(out, exist_ok=True)
    if FLAGS.limit:
        data = {name: write_sample(out if writer else None, name, examples, FLAGS.limit, FLAGS.seed)
                for name, examples in data.items()}
    results = evaluate_run(run, data, modes, out if writer else None)
    if writer:
        print(results_table(results, list(data)))
        print(f"wrote {out}/results.md, results.json and per-question predictions")


if __name__ == "__main__":
    define_flags()
    app.run(lambda argv: exit_on_error(lambda: main(argv)), flags_parser=parse_flags)
