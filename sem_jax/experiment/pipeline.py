"""SEM's effect on a real checkpoint, one stage after another, each resumable:

1. data: real MMLU and GSM8K (scripts/fetch_real_data.py), the invented multi-hop world, written
   into OUT/data;
2. warm: the format warm start (`sem_jax.sft` with `sft.decision = "random"`: a share of traces
   search whatever the question), from `model.path` into OUT/warm;
   known (with `experiment.known = "warm_right"`): the warm start, greedy, on the training MMLU
   questions; those it answers right first make the known half of both GRPO runs' training mix
   (OUT/known);
3. sem: GRPO with the SEM protocol from the warm start (OUT/sem);
4. eval/warm, eval/sem: the warm start and SEM's policy evaluated in every mode of
   `experiment.modes`, on MMLU, the multi-hop world and GSM8K (OUT/eval/<policy>);
5. research: GRPO with the ReSearch protocol from the base model, as ReSearch trains (its system
   prompt, with its inline example, teaches its format; it has no supervised start) (OUT/research),
   then eval/research (under its own protocol);
6. eval/base: the base model (SEM's prompt with its worked example, its only way to the format);
7. report: OUT/report.md, report.json and curves.png; also written, marked partial, after each
   evaluation, so that a run stopped early reports what it has.

A stage that finished is not run again; a training stage killed midway resumes from its last
checkpoint (`train.ckpt_every`), an evaluation from its first unfinished policy.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

from sem_jax.assemble import build_evaluation
from sem_jax.checkpoint import Checkpointer
from sem_jax.data.mix import sem_mix
from sem_jax.data.questions import load_questions, question_row
from sem_jax.evaluate import evaluate_run, parse_modes
from sem_jax.errors import Refused, read_json
from sem_jax.experiment.data import EVAL_SETS, prepare_data, real_file, write_jsonl
from sem_jax.experiment.report import write_report
from sem_jax.rewards.answers import score_answer
from sem_jax.config import Config, changed_fields
from sem_jax.sft import finetune
from sem_jax.train import train

POLICIES = ("base", "warm", "sem", "research")
DONE = "finished.json"  # a training or evaluation stage's last file


def _stage(name: str, t0: float) -> None:
    print(f"\n=== experiment: {name} ({time.perf_counter() - t0:.0f}s in) ===", flush=True)


def _mark(directory: str, content: dict) -> None:
    with open(os.path.join(directory, DONE), "w") as fh:
        json.dump(content, fh, indent=1)


def _finished(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, DONE))


def stage_configs(config: Config, out: str, files: dict[str, str]) -> dict[str, Config]:
    """The config of each training and evaluation stage: the experiment's, without its own section,
    on the experiment's data, each with its start, protocol and run directory."""
    base = config.model.path
    train = known_file(out) if config.experiment.known == "warm_right" else files["train"]
    common = config.replace(**{"experiment": None, "data.train_file": files["train"], "data.eval_file": files["eval"],
                               "retrieval.corpus": files["corpus"], "retrieval.index_dir": None})
    warm = os.path.join(out, "warm")
    return {
        "warm": common.replace(**{"sft.decision": "random", "protocol": "sem", "prompt_example": False,
                                  "run_dir": os.path.join(out, "warm.run")}),
        "sem": common.replace(**{"model.path": warm, "protocol": "sem", "prompt_example": False,
                                 "run_dir": os.path.join(out, "sem"), "data.train_file": train}),
        "research": common.replace(**{"model.path": base, "protocol": "research", "run_dir": os.path.join(out, "research"),
                                      "data.train_file": train}),
        "eval/base": common.replace(**{"protocol": "sem", "prompt_example": True}),
        "eval/warm": common.replace(**{"model.path": warm, "protocol": "sem", "prompt_example": False}),
    }


def _evaluate(config: Config, out: str, files: dict[str, str], modes: list[str], *, hf: str | None = None,
              checkpoint: str | None = None) -> None:
    os.makedirs(out, exist_ok=True)
    run = build_evaluation(config, checkpoint=checkpoint, hf=hf)
    data = {name: run.cap(load_questions(files[name]), name) for name in EVAL_SETS}
    evaluate_run(run, data, modes, out)
    _mark(out, {"protocol": config.protocol, "source": hf or checkpoint, "modes": modes,
                "questions": {name: len(examples) for name, examples in data.items()}})


def known_file(out: str) -> str:
    return os.path.join(out, "known", "train.jsonl")


def known_stage(config: Config, out: str, files: dict[str, str], seed: int) -> None:
    """Known for this model: the warm start, greedy, in the policy mode, on the training file's
    MMLU questions. Those whose first answer is right (a guess that lands counts too) and the
    multi-hop questions make a new 1:1 training mix, OUT/known/train.jsonl. Never the evaluation
    questions: they stay as drawn."""
    where = os.path.dirname(known_file(out))
    os.makedirs(where, exist_ok=True)
    run = build_evaluation(config, hf=os.path.join(out, "warm"))
    train = load_questions(files["train"])
    asked = run.cap([e for e in train if not e.needs_search], "mmlu_train")
    evaluate_run(run, {"mmlu_train": asked}, ["policy"], where)
    by_id, parse = {e.id: e for e in asked}, config.chat_protocol().parse
    right = []
    with open(os.path.join(where, "predictions_policy_mmlu_train.jsonl")) as fh:
        for line in fh:
            r = json.loads(line)
            first = parse(r["response"], r["end_reason"] == "eos").first_answer
            if score_answer(first, by_id[r["id"]])[0] == 1.0:
                right.append(by_id[r["id"]])
    if not right:
        raise Refused(f"{where}: the warm start answered none of the {len(asked)} training MMLU questions right "
                      "first: nothing is known to it; use experiment.known='label'")
    mix = sem_mix([e for e in train if e.needs_search], right, seed=seed)
    write_jsonl(known_file(out), [question_row(e) for e in mix])
    _mark(where, {"asked": len(asked), "right_first": len(right),
                  "train": {"known (mmlu, right first)": sum(not e.needs_search for e in mix),
                            "unknown (multihop)": sum(e.needs_search for e in mix)}})


# The goal's headline first (the warm start against SEM's policy), so that a run cut short by a
# time limit has answered most of it: then ReSearch, then the base model.
STAGES = ("warm", "known", "sem", "eval/warm", "eval/sem", "research", "eval/research", "eval/base")


def stages(config: Config) -> tuple[str, ...]:
    """The stages `config` runs: "known" only where known is the warm start's."""
    return tuple(n for n in STAGES if n != "known" or config.experiment.known == "warm_right")


def stage_done(out: str, name: str) -> bool:
    if name == "warm":  # the warm start's HF directory is written whole or not at all
        return os.path.exists(os.path.join(out, "warm", "config.json"))
    return _finished(os.path.join(out, name))


def run_stage(config: Config, out: str, name: str) -> None:
    """One stage of `STAGES` in this process (the data are prepared)."""
    files = prepare_data(config.experiment, config.seed, os.path.join(out, "data"))
    cfgs = stage_configs(config, out, files)
    if name == "warm":
        finetune(cfgs["warm"], os.path.join(out, "warm"))
    elif name == "known":
        known_stage(cfgs["eval/warm"], out, files, config.seed)
    elif name in ("sem", "research"):
        train_stage(cfgs[name], name)
    elif name.startswith("eval/"):
        policy = name.split("/", 1)[1]
        cfg, source = {"base": (cfgs["eval/base"], dict(hf=config.model.path)),
                       "warm": (cfgs["eval/warm"], dict(hf=os.path.join(out, "warm"))),
                       "sem": (cfgs["sem"], dict(checkpoint=os.path.join(cfgs["sem"].run_dir, "ckpt"))),
                       "research": (cfgs["research"], dict(checkpoint=os.path.join(cfgs["research"].run_dir, "ckpt")))
                       }[policy]
        _evaluate(cfg, os.path.join(out, name), files, parse_modes(config.experiment.modes), **source)
    else:
        raise ValueError(f"stage {name!r}; choose one of {STAGES}")


def train_stage(cfg: Config, name: str) -> None:
    """Train (or resume) `name`'s run; marked finished only once it has reached its last step."""
    metrics = train(cfg)
    # A stop signal ends training early and cleanly (saved, exit 0): not the end of the stage.
    reached = Checkpointer(os.path.join(cfg.run_dir, "ckpt"), read_only=True).latest_step()
    if reached != cfg.train.total_steps:
        raise Refused(f"{cfg.run_dir}: training stopped at step {reached} of {cfg.train.total_steps}, so the "
                      f"{name} stage is not finished; run the same command again to resume it")
    _mark(cfg.run_dir, {"last_step_metrics": metrics})


def saved_config(config: Config, out: str) -> None:
    """OUT/experiment.json: the config every stage's process reads. A resumed run must bring the
    same one (its stages' outputs were made with it)."""
    path = os.path.join(out, "experiment.json")
    if not os.path.exists(path):
        with open(path, "w") as fh:
            fh.write(config.to_json())
        return
    # A field newer than the run is no change while it keeps its default (the run had that behaviour).
    changed = list(changed_fields(read_json(path, "the experiment's config, written at its first start: restore it, "
                                                  "or start again in a new --out"), config))
    if changed:
        raise ValueError(f"{out} holds an experiment run with another config (changed: {', '.join(changed[:6])}); "
                         "resume it with the same config, or choose another --out")


def check_inputs(config: Config) -> None:
    """What the stages read, checked at start: the model directory, the real data files, and
    matplotlib for the report's curves (in the `demo` extra), each named when missing."""
    path = config.model.path
    if not os.path.exists(os.path.join(path, "config.json")):
        raise Refused(f"model.path={path}: no config.json there; fetch the checkpoint first "
                      "(scripts/fetch_real_model.py) or point model.path at a Hugging Face directory")
    for name in ("mmlu_test.jsonl", "gsm8k_test.jsonl"):
        real_file(config.experiment.data_dir, name)
    if importlib.util.find_spec("matplotlib") is None:
        raise Refused("sem_jax.experiment draws its curves with matplotlib, which is not installed: "
                      "pip install -e '.[demo]'")


def run_experiment(config: Config, out: str) -> dict:
    """Every stage into `out` (resuming what a killed run left), each training and evaluation stage
    in a process of its own (all of its memory returned when it ends); returns report.json's content."""
    exp = config.experiment
    if exp is None:
        raise ValueError("sem_jax.experiment needs a config with an `experiment` section (configs/real_experiment.py)")
    if not config.model.path:
        raise ValueError("sem_jax.experiment trains a pretrained checkpoint: set model.path to its HF directory")
    parse_modes(exp.modes)  # refused now, not after the training
    check_inputs(config)  # before OUT/experiment.json pins the config: the corrected command must resume
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    saved_config(config, out)
    t0 = time.perf_counter()
    _stage("data", t0)
    files = prepare_data(exp, config.seed, os.path.join(out, "data"))
    with open(os.path.join(out, "data", "summary.json")) as fh:
        print(fh.read(), flush=True)
    for name in stages(config):
        _stage(name, t0)
        if stage_done(out, name):
            print(f"{os.path.join(out, name)}: finished before, reused", flush=True)
            continue
        proc = subprocess.run([sys.executable, "-m", "sem_jax.experiment.stage", out, name])
        if proc.returncode != 0:
            raise RuntimeError(f"experiment stage {name} failed (exit {proc.returncode}); its output is above. "
                               f"Run the same command again to resume from there")
        if name.startswith("eval/"):  # what has run so far, in case the run is stopped before the end
            _report(config, out, files, show=False)
    _stage("report", t0)
    return _report(config, out, files)


def _report(config: Config, out: str, files: dict[str, str], show: bool = True) -> dict:
    cfgs = stage_configs(config, out, files)
    runs = {"SEM": cfgs["sem"].run_dir, "ReSearch": cfgs["research"].run_dir}
    note = (f"{os.path.basename(config.model.path.rstrip('/'))}: {config.train.total_steps} GRPO steps of "
            f"{config.data.prompts_per_step} prompts x {config.rollout.group_size}, seed {config.seed}")
    if config.experiment.known == "warm_right":
        note += "; GRPO's known questions: the training MMLU questions the warm start answers right first"
        if stage_done(out, "known"):
            note += " ({right_first} of {asked})".format(**read_json(os.path.join(out, "known", DONE), "the known stage"))
    pending = [name for name in stages(config) if not stage_done(out, name)]
    if pending:
        note += f". Partial: {', '.join(pending)} not run yet"
    return write_report(out, list(POLICIES), runs, list(EVAL_SETS), note, show=show)
