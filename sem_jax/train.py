"""GRPO training with the SEM reward.

    python -m sem_jax.train                                  # configs/cpu.py: a tiny model on the CPU
    python -m sem_jax.train --config configs/tpu_v4.py --config.rl.beta=0.0

Each step: rollout (G trajectories per question, searches answered by bm25) -> rewards
-> group-relative advantages -> reference log-probs -> one jitted update -> metrics ->
checkpoint -> evaluation. Metrics go to the console, TensorBoard and metrics.jsonl in
`run_dir`; checkpoints to `run_dir/ckpt`. Restarting with the same run_dir resumes from the
last complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import logging as absl_logging
from flax import nnx
from ml_collections import ConfigDict, config_flags

from sem_jax.assemble import TrainRun, build_train
from sem_jax.checkpoint import Checkpointer
from sem_jax.config import one_line_config_errors, parse_flags
from sem_jax.data.example import Example
from sem_jax.distributed import initialize as initialize_distributed
from sem_jax.distributed import started as distributed_started
from sem_jax.errors import exit_on_error
from sem_jax.policy_eval import RECORD_KEYS, aggregate, policy_scores, score_trajectory, top_reasons
from sem_jax.hosts import agree_max, check_shared_dir, gather_json, to_global
from sem_jax.metrics import MetricWriter
from sem_jax.model import Qwen2Config
from sem_jax.model import lora as lora_lib
from sem_jax.rl.advantages import group_advantages, tied_groups
from sem_jax.rl.batch import batch_width, build_batch, response_width
from sem_jax.rl.trainer import learning_rate
from sem_jax.run_lock import RunLock
from sem_jax.sampling import RolloutStats, Trajectory
from sem_jax.sampling.sampler import compute_weights
from sem_jax.rewards.rules import CASES, get_reward
from sem_jax.config import Config, load, resume_changes, run_config
from sem_jax.sharding import replicate, shard_params

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "cpu.py")


# -- building blocks ---------------------------------------------------------------------

def batch_at(examples: list, step: int, per_step: int, seed: int) -> list:
    """Questions for `step`: consecutive slices of per-epoch seeded permutations, so the order
    is a function of the step alone (a resumed run continues with the same next batch)."""
    n = len(examples)
    out = []
    for k in range(step * per_step, (step + 1) * per_step):
        order = np.random.RandomState(seed + k // n).permutation(n)
        out.append(examples[order[k % n]])
    return out


def step_flops(model_cfg: Qwen2Config, rollout_tokens: int, train_tokens: int, ref: bool) -> float:
    """2 x matmul params x tokens per pass: rollout 1, reference 1, update 3 (fwd + bwd)."""
    return 2.0 * model_cfg.matmul_params * (rollout_tokens + train_tokens * (3 + int(ref)))


@dataclasses.dataclass
class TrainState:
    """The arrays and counters a checkpoint holds (the reference and a LoRA base are rebuilt from
    the start)."""
    params: Any                     # the policy's weights; with LoRA its adapters
    opt_state: Any
    ref_params: Any                 # None when rl.beta == 0; with LoRA the base itself
    step: int = 0
    skipped_total: int = 0          # updates not applied (non-finite loss or gradients)
    base: Any = None                # LoRA: the frozen weights the adapters adapt
    base_id: str | None = None      # LoRA: the base's `lora.fingerprint`, recorded in each checkpoint


@dataclasses.dataclass
class Scored:
    """One step's trajectories on this process, with their rewards."""
    examples: list[Example]
    trajs: list[Trajectory]
    stats: RolloutStats
    rewards: list[float]
    cases: list[str]
    records: list[dict]
    advantages: np.ndarray
    seconds: float


def initial_state(run: TrainRun, ckpt: Checkpointer) -> TrainState:
    """The policy's parameters, sharded, with a fresh optimizer; or the last checkpoint's."""
    with jax.set_mesh(run.mesh):
        _, params = nnx.split(run.model)
        params = shard_params(params, run.mesh)
        beta = run.config.rl.beta > 0
        spec = run.trainer.lora
        base = ref_params = None
        if spec is not None:  # the base is frozen: it is the reference too, no copy
            base, ref_params = params, params if beta else None
            params = replicate(lora_lib.init_adapters(spec, run.model_config, run.config.seed), run.mesh)
            print(f"{spec.describe()}: {sum(x.size for x in jax.tree.leaves(params)):,} trained parameters",
                  flush=True)
        elif beta:
            # The frozen reference is the initial policy (rebuilt identically on resume), in the compute
            # dtype: every use casts a weight to it first, so the same log-probs from half the memory.
            ref_params = reference_weights(params, run.model.dtype)
        state = TrainState(params, run.trainer.init_opt_state(params), ref_params, base=base,
                           base_id=None if base is None else lora_lib.fingerprint(base))
    restored = ckpt.restore_newest(state.params, state.opt_state)
    if restored is not None:
        _, state.params, state.opt_state, meta = restored
        lora_lib.check_base(meta.get("lora_base"), state.base_id, run.config.model.path, ckpt.directory)
        state.step, state.skipped_total = meta["step"], meta["skipped_total"]
        print(f"resumed from step {state.step} ({ckpt.directory})", flush=True)
    return state


def policy_weights(state: TrainState, spec: lora_lib.LoraSpec | None) -> Any:
    """The policy's whole weights: the parameters, or the base with the adapters merged in."""
    return state.params if spec is None else lora_lib.merge(spec, state.base, state.params)


def reference_weights(params: Any, dtype: Any) -> Any:
    """A frozen copy of `params` in the compute `dtype` (`compute_weights`; a copy when it casts
    nothing, since the update donates `params`)."""
    ref = compute_weights(params, dtype)
    return jax.tree.map(jnp.copy, ref) if ref is params else ref


def step_questions(run: TrainRun, step: int) -> list[Example]:
    """This process's slice of the step's global batch (the same for any number of processes)."""
    c = run.config
    pid = jax.process_index()
    examples = batch_at(run.train_set, step, c.data.prompts_per_step, c.seed)
    examples = examples[pid * run.per_host:(pid + 1) * run.per_host]
    if c.train.debug_hosts:
        with open(os.path.join(run.run_dir, f"questions.process{pid}.jsonl"), "a") as fh:
            fh.write(json.dumps({"step": step + 1, "ids": [e.id for e in examples]}) + "\n")
    return examples


def rollout_and_score(run: TrainRun, state: TrainState, examples: list[Example]) -> Scored:
    """G trajectories per question, their rewards and group-relative advantages."""
    c = run.config
    protocol, reward, system_prompt = c.chat_protocol(), get_reward(c.reward_name()), c.prompt()
    prompts = [protocol.encode_prompt(run.tokenizer, e, system_prompt) for e in examples]
    run.engine.set_weights(policy_weights(state, run.trainer.lora))
    with jax.set_mesh(run.mesh):
        t0 = time.perf_counter()
        trajs, stats = run.engine.run(prompts, jax.random.fold_in(jax.random.key(c.seed), state.step))
        seconds = time.perf_counter() - t0
    run.engine.release()  # the update's peak memory holds no sampler copy of the weights
    rewards, cases, records = [], [], []
    for t in trajs:
        ex = examples[t.prompt_index]
        rew, case = reward(protocol.parse(t.text, t.end_reason == "eos"), ex, c.reward_params)
        rewards.append(rew)
        cases.append(case)
        records.append(score_trajectory(t, ex, protocol))
    adv = group_advantages(np.array(rewards), c.rollout.group_size, eps=c.rl.adv_eps,
                           scale_by_std=c.rl.scale_adv_by_std)
    return Scored(examples, trajs, stats, rewards, cases, records, adv, seconds)


def update(run: TrainRun, state: TrainState, scored: Scored) -> tuple[dict, dict[str, np.ndarray], dict[str, float]]:
    """Reference log-probs and one optimizer step (in place on `state`); returns the update's
    metrics, this process's batch rows and the pass times."""
    width, response = (agree_max(f(scored.trajs)) for f in (batch_width, response_width))
    host = build_batch(scored.trajs, scored.advantages, micro_batch=run.row_multiple, pad_id=run.pad_id,
                       width=width, response=response, group_size=run.config.rollout.group_size)
    with jax.set_mesh(run.mesh):
        batch = {k: to_global(v, run.mesh) for k, v in host.items()}
        run.calls.record("update", batch)
        t0 = time.perf_counter()
        ref_lp = run.trainer.reference_logprobs(state.ref_params, batch)
        if ref_lp is not None:
            ref_lp.block_until_ready()
        t_ref = time.perf_counter() - t0
        t0 = time.perf_counter()
        state.params, state.opt_state, m = run.trainer.update(state.params, state.opt_state, batch, ref_lp,
                                                              base=state.base)
        m = jax.device_get(m)
    times = {"time/reference": t_ref, "time/update": time.perf_counter() - t0}
    return m, host, times


def step_metrics(run: TrainRun, state: TrainState, scored: Scored, m: dict, host: dict, times: dict,
                 t_start: float) -> dict[str, float]:
    """The step's metrics over every process's trajectories (advances `state.skipped_total`)."""
    lr = float(learning_rate(run.trainer.optim)(state.step - state.skipped_total))  # optax counts applied updates
    state.skipped_total += int(m["skipped"])
    g = run.config.rollout.group_size
    shares = gather_json({"rewards": scored.rewards, "cases": scored.cases, "adv": np.abs(scored.advantages).tolist(),
                          "tied": tied_groups(scored.rewards, g), "groups": len(scored.rewards) // g,
                          "records": [{k: r[k] for k in RECORD_KEYS} for r in scored.records],
                          "sampled": int(sum(t.loss_mask.sum() for t in scored.trajs)),
                          "train_tokens": int((host["inputs"] != run.pad_id).sum())})
    rewards, cases, records = (sum((x[k] for x in shares), []) for k in ("rewards", "cases", "records"))
    adv = np.array(sum((x["adv"] for x in shares), []))
    sampled, train_tokens, tied, n_groups = (sum(x[k] for x in shares) for k in ("sampled", "train_tokens", "tied",
                                                                                 "groups"))
    seconds = time.perf_counter() - t_start
    rs = scored.stats
    metrics = {"reward/mean": float(np.mean(rewards)), "reward/std": float(np.std(rewards)),
               **{f"reward/case_{c}": cases.count(c) / len(cases) for c in CASES if c in cases},
               "loss": float(m["loss"]), "lr": lr, "kl": float(m["kl"]), "entropy": float(m["entropy"]),
               "clip_frac": float(m["clip_frac"]), "grad_norm": float(m["grad_norm"]),
               "skipped_steps": state.skipped_total, "sampler_gap": float(m["sampler_gap"]),
               "adv/abs_mean": float(np.abs(adv).mean()),
               "groups/tied": tied / n_groups,  # all G rewards equal: zero advantage, no signal
               "tokens_per_s": sampled / max(scored.seconds, 1e-9), "time/step": seconds,
               "time/rollout": scored.seconds, **rs.metrics(), **times}
    metrics.update(aggregate(records))
    if run.config.peak_flops:
        flops = step_flops(run.model.config, sampled, train_tokens, state.ref_params is not None)
        metrics["mfu"] = flops / seconds / (run.config.peak_flops * jax.device_count())
    return metrics


def evaluate_policy(run: TrainRun, state: TrainState) -> dict[str, float]:
    """Greedy evaluation on the held-out questions, every process its share."""
    run.greedy.set_params(policy_weights(state, run.trainer.lora))
    c = run.config
    scores = policy_scores(run.greedy, run.tokenizer, run.retriever, run.eval_set, c.engine(), run.eval_batch,
                           c.prompt(), c.chat_protocol(), run.mesh)
    run.calls.check(f"eval at step {state.step}")
    return scores


def check_start_validity(scores: dict[str, float], threshold: float, protocol: str) -> bool:
    """Warn when the initial policy seldom writes the protocol's format: its groups' rewards then
    tie and GRPO has nothing to learn from. Returns whether validity reached `threshold`."""
    if scores["valid"] >= threshold:
        return True
    print(f"WARNING: at step 0 only {100 * scores['valid']:.0f}% of the initial policy's held-out responses follow "
          f"the {protocol} format (train.min_start_valid={threshold}); rejected as {top_reasons(scores, 4)}"
          + ". Groups whose rewards all tie (groups/tied) give GRPO no signal: warm-start the format with "
          "supervised traces first (sem_jax.sft), or show it in the prompt (--config.prompt_example=True).",
          flush=True)
    return False


class StopSignals:
    """SIGTERM and SIGINT in a run without the distributed runtime: the step in flight finishes,
    is saved, and the run exits cleanly (a restart resumes from it); a second signal stops at
    once. With the runtime, JAX syncs SIGTERM across processes and orbax reports it instead
    (`reached_preemption`): one process stopping alone would leave the others waiting."""

    def __init__(self):
        self.received: int | None = None
        # Handlers can only be set from the main thread (a run started from a thread keeps the defaults).
        self.previous = {}
        if not distributed_started() and threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def __enter__(self) -> "StopSignals":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def _handle(self, signum, frame):
        self.received = signum
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        print(f"{signal.Signals(signum).name}: finishing this step, then saving and exiting (again to stop now)",
              flush=True)

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}


def save(run: TrainRun, ckpt: Checkpointer, state: TrainState) -> None:
    ckpt.save(state.step, state.params, state.opt_state,
              {"step": state.step, "data_position": state.step * run.config.data.prompts_per_step,
               "skipped_total": state.skipped_total, "seed": run.config.seed,
               **({"lora_base": state.base_id} if state.base_id else {})})


# -- the loop ----------------------------------------------------------------------------

def train(config: Config) -> dict[str, float]:
    """Run (or resume) training as configured; returns the last step's metrics."""
    run_dir = os.path.abspath(config.run_dir)
    os.makedirs(run_dir, exist_ok=True)
    check_shared_dir(run_dir)
    # One trainer per run_dir (process 0 holds it for a multi-process run), before any file is written.
    lock = RunLock(run_dir).acquire() if jax.process_index() == 0 else None
    try:
        return _train(config, run_dir)
    finally:
        if lock:
            lock.release()


def _train(config: Config, run_dir: str) -> dict[str, float]:
    ckpt = Checkpointer(os.path.join(run_dir, "ckpt"), keep=config.train.keep_checkpoints)
    resuming = ckpt.latest_step() is not None
    saved = os.path.join(run_dir, "config.json")
    changes = resume_changes(run_config(run_dir, ""), config, saved) if resuming and os.path.exists(saved) else {}
    run = build_train(config, resuming=resuming)
    state = initial_state(run, ckpt)
    # Only once the checkpoint (if any) restored under this config, and never over a resumed run's:
    # config.json stays the config it trained with (evaluate and export read it); what a resume
    # changed goes to resumes.jsonl, with the step it resumed from.
    if jax.process_index() == 0:
        if changes:
            with open(os.path.join(run_dir, "resumes.jsonl"), "a") as fh:
                fh.write(json.dumps({"step": state.step, "changed": changes}) + "\n")
            print(f"resumed at step {state.step} with changes (resumes.jsonl): "
                  + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items()), flush=True)
        if not (resuming and os.path.exists(saved)):
            with open(saved, "w") as fh:
                fh.write(config.to_json())
    writer = MetricWriter(run_dir, resumed_step=state.step)
    t = config.train
    total, start = t.total_steps, state.step
    metrics: dict[str, float] = {}

    def evaluate_and_log():
        scores = evaluate_policy(run, state)
        writer.write(state.step, scores, prefix="eval", total=total)
        return scores

    if t.eval_at_start and start == 0:
        check_start_validity(evaluate_and_log(), t.min_start_valid, run.config.protocol)
    with StopSignals() as stop:
        while state.step < total:
            t_step = time.perf_counter()
            scored = rollout_and_score(run, state, step_questions(run, state.step))
            m, host, times = update(run, state, scored)
            run.calls.check(f"step {state.step + 1}")
            metrics = step_metrics(run, state, scored, m, host, times, t_step)
            state.step += 1
            if state.step % t.log_every == 0 or state.step == total:
                writer.write(state.step, metrics, total=total)
            # A signal, or a TPU maintenance / spot preemption notice: save now, exit cleanly,
            # resume on relaunch.
            stopping = bool(stop.received) or ckpt.manager.reached_preemption(state.step)
            if stopping or state.step % t.ckpt_every == 0 or state.step == total:
                save(run, ckpt, state)
            else:
                ckpt.check()  # a background save that failed stops the run at the next step
            if stopping:
                ckpt.close()
                writer.close()
                why = signal.Signals(stop.received).name if stop.received else "preemption notice"
                print(f"{why}: saved step {state.step}, exiting", flush=True)
                return metrics
            if t.debug_kill_at_step == state.step:
                ckpt.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            if t.eval_every and state.step % t.eval_every == 0 and state.step != total:
                evaluate_and_log()
    ckpt.close()
    # The final evaluation, also when a run stopped during it restarts: its row is what the
    # uninterrupted run would have written (process 0 reads the file; every process evaluates).
    if agree_max(int(not writer.logged(total, "eval"))):
        metrics.update({f"eval/{k}": v for k, v in evaluate_and_log().items()})
    writer.close()
    return metrics


def define_flags():
    # Defined only when run as a program: importing this module (tests, other entry points)
    # must not register a second --config.
    global _CONFIG
    with one_line_config_errors(DEFAULT_CONFIG):
        _CONFIG = config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Training config file (ml_collections).",
                                                  lock_config=True)


def cli(argv: list[str], config: ConfigDict, prepare: Callable[[Config], Config] | None = None) -> None:
    """The command line's run: the config file's settings checked, the multi-process runtime
    started, the config `prepare`d (the demo writes its world and warm start there), training."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    # Orbax logs every file operation at INFO through absl; keep the console readable.
    absl_logging.set_verbosity(absl_logging.WARNING)

    def run():
        cfg = load(config)
        initialize_distributed(cfg.distributed)  # first: before anything starts a backend
        return train(prepare(cfg) if prepare else cfg)
    exit_on_error(run)


def main(argv: list[str]) -> None:
    cli(argv, _CONFIG.value)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
