"""The experiment's questions and corpus, written once into OUT/data.

Known questions: real MMLU (test split, from scripts/fetch_real_data.py), a training sample and a
disjoint evaluation sample, each stratified by subject. Out of domain: real GSM8K test questions,
evaluation only. Unknown questions: the invented multi-hop world (`world.py`), training and
evaluation about disjoint people. The training file mixes known and unknown 1:1 (`sem_mix`).
"""

from __future__ import annotations

import json
import os

from sem_jax.data.mix import sem_mix, stratified_sample
from sem_jax.data.questions import question_row
from sem_jax.data.sources import load_source
from sem_jax.experiment.world import build_multihop_world
from sem_jax.config import Experiment

FETCH = "python scripts/fetch_real_data.py --out {dir}"
# Data set name -> file under OUT/data: what the evaluation reads, beside train.jsonl and eval.jsonl.
EVAL_SETS = ("mmlu", "multihop", "gsm8k")
SUMMARY = "summary.json"  # written last: its presence means OUT/data is complete


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path + ".tmp", "w") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(path + ".tmp", path)


def real_file(data_dir: str, name: str) -> str:
    path = os.path.join(os.path.expanduser(data_dir), name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: not found; fetch the real data sets first: "
                                + FETCH.format(dir=data_dir))
    return path


def prepare_data(exp: Experiment, seed: int, out: str) -> dict[str, str]:
    """Write OUT/data (once: a finished one is reused) and return its files by name: train, eval
    (the held-out questions GRPO's periodic evaluation reads: MMLU's and the world's), corpus,
    and one file per evaluation set (`EVAL_SETS`)."""
    files = {name: os.path.join(out, f"{name}.jsonl") for name in ("train", "eval", "corpus", *EVAL_SETS)}
    if os.path.exists(os.path.join(out, SUMMARY)):
        return files
    os.makedirs(out, exist_ok=True)
    mmlu = load_source("mmlu", real_file(exp.data_dir, "mmlu_test.jsonl"), split="test")
    gsm8k = load_source("gsm8k", real_file(exp.data_dir, "gsm8k_test.jsonl"), split="test")
    if exp.mmlu_train + exp.mmlu_eval > len(mmlu):
        raise ValueError(f"experiment.mmlu_train + mmlu_eval = {exp.mmlu_train + exp.mmlu_eval} > the "
                         f"{len(mmlu)} MMLU questions")
    mmlu_eval = stratified_sample(mmlu, exp.mmlu_eval, seed)
    held = {e.id for e in mmlu_eval}
    mmlu_train = stratified_sample([e for e in mmlu if e.id not in held], exp.mmlu_train, seed)
    world = build_multihop_world(seed, people=exp.people, eval_people=exp.eval_people,
                                 organisations=exp.organisations, cities=exp.cities, countries=exp.countries)
    hop_train, hop_eval = world.questions("train"), stratified_sample(world.questions("eval"), exp.multihop_eval, seed)
    train = sem_mix(hop_train, mmlu_train, seed=seed)
    sets = {"mmlu": mmlu_eval, "multihop": hop_eval, "gsm8k": stratified_sample(gsm8k, exp.gsm8k_eval, seed)}
    for name, examples in sets.items():
        write_jsonl(files[name], [question_row(e) for e in examples])
    write_jsonl(files["train"], [question_row(e) for e in train])
    write_jsonl(files["eval"], [question_row(e) for e in mmlu_eval + hop_eval])
    passages = world.passages()
    write_jsonl(files["corpus"], passages)
    summary = {"train": {"known (mmlu)": sum(not e.needs_search for e in train),
                         "unknown (multihop)": sum(e.needs_search for e in train)},
               "eval": {name: len(examples) for name, examples in sets.items()},
               "corpus passages": len(passages), "seed": seed, "data_dir": exp.data_dir}
    with open(os.path.join(out, SUMMARY), "w") as fh:
        json.dump(summary, fh, indent=1)
    return files
