"""GRPO training with the SEM reward.

    python -m sem_jax.train                                  # the embedded CPU demo config
    python -m sem_jax.train --config configs/tpu_v4.py --config.rl.beta=0.0

Each step: rollout (G trajectories per question, searches answered by bm25) -> rewards
-> group-relative advantages -> reference log-probs -> one jitted update. Metrics go to
the console, TensorBoard and metrics.jsonl in `run_dir`; checkpoints to `run_dir/ckpt`.
Restarting with the same run_dir resumes from the last complete checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import logging as absl_logging
from flax import nnx
from ml_collections import ConfigDict, config_flags

from sem_jax.checkpoint import Checkpointer
from sem_jax.builders import build_policy, build_retriever
from sem_jax.data.mix import process_share
from sem_jax.data.questions import load_questions
from sem_jax.data.synthetic import build_world, summarize, use_world_files, world_config
from sem_jax.data.synthetic import texts as synthetic_texts
from sem_jax.sft import warm_start
from sem_jax.distributed import initialize as initialize_distributed
from sem_jax.eval_lib import RECORD_KEYS, aggregate, run_mode, score_trajectory
from sem_jax.hosts import (CallLog, agree_max, batch_shards, check_shared_dir, gather_json, local_batch_multiple,
                           to_global)
from sem_jax.metrics import MetricWriter
from sem_jax.model import Qwen2Config
from sem_jax.rl.advantages import group_advantages
from sem_jax.rl.batch import batch_width, build_batch, response_width
from sem_jax.rl.loss import GRPOConfig
from sem_jax.rl.trainer import GRPOTrainer, OptimConfig, learning_rate
from sem_jax.sampling import RolloutConfig, Sampler, SamplingConfig, build_stop_automaton, rollout
from sem_jax.sem.parse import parse_response
from sem_jax.sem.reward import CASES, RewardParams, get_reward
from sem_jax.sem.template import encode_prompt
from sem_jax.sharding import make_mesh, shard_params

log = logging.getLogger("sem_jax.train")
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                              "demo_cpu.py")


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


# -- the loop ----------------------------------------------------------------------------

def train(config: ConfigDict) -> dict[str, float]:
    """Run (or resume) training as configured; returns the last step's metrics."""
    get_reward(config.reward)  # fail fast on an unknown reward name
    pid, nproc = jax.process_index(), jax.process_count()
    # Each process rolls out its own share of every step's questions (hosts.py).
    if config.data.prompts_per_step % nproc:
        raise ValueError(f"data.prompts_per_step={config.data.prompts_per_step} must divide by the "
                         f"{nproc} processes")
    per_host = config.data.prompts_per_step // nproc
    run_dir = os.path.abspath(config.run_dir)
    os.makedirs(run_dir, exist_ok=True)
    check_shared_dir(run_dir)
    world = None
    if config.world.enabled:  # the CPU demo: generate (deterministically) and use the synthetic world
        world = build_world(world_config(config))
        use_world_files(config, world.write(os.path.join(run_dir, "world")))
        print(summarize(world), flush=True)
    if jax.process_index() == 0:
        with open(os.path.join(run_dir, "config.json"), "w") as fh:
            fh.write(config.to_json_best_effort(indent=2))
    mesh = make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    train_set = load_questions(config.data.train_file)
    eval_all = load_questions(config.data.eval_file)[:config.data.eval_questions]
    eval_set = process_share(eval_all, pid, nproc)  # each process evaluates its share
    if not eval_set:
        raise ValueError(f"{nproc} processes need at least as many eval questions (data.eval_questions)")
    retriever = build_retriever(config)
    # Text for the demo's own BPE; only read when no pretrained model is given.
    if world is not None:
        texts = lambda: synthetic_texts(world) + [config.system_prompt] * 50  # repeated: its words merge
    else:
        texts = lambda: [config.system_prompt] + [e.question + " " + " ".join(e.answers)
                                                  for e in train_set + eval_all] + \
            [f"{d['title']} {d['text']}" for d in retriever.passages()]
    model, tokenizer = build_policy(config, texts, run_dir, mesh)
    if config.warm_start.steps and not config.model.path:
        if world is None:
            raise ValueError("warm_start.steps > 0 needs the synthetic world (world.enabled=True) for its traces")
        model = warm_start(config, model, tokenizer, retriever, world, run_dir)

    rp = RewardParams(**config.reward_params.to_dict())
    reward_fn = get_reward(config.reward)
    grpo = GRPOConfig(beta=config.rl.beta, clip_eps=config.rl.clip_eps, clip_eps_high=config.rl.clip_eps_high,
                      loss_agg=config.rl.loss_agg, dr_grpo_length=config.rollout.max_new_tokens)
    optim = OptimConfig(total_steps=config.train.total_steps, **config.optim.to_dict())
    g = config.rollout.group_size
    rows = config.data.prompts_per_step * g
    micro = min(config.rl.micro_batch, rows)
    if micro % nproc:
        raise ValueError(f"rl.micro_batch={micro} must divide by the {nproc} processes")
    trainer = GRPOTrainer(model, grpo, optim, micro_batch=micro, logprob_chunk=config.rl.logprob_chunk,
                          group_size=g, shards=batch_shards(mesh))
    # Each process pads its rows so that the global batch splits into micro-batches and
    # over the batch shards, and its groups stay whole runs of the trainer's shared prompts.
    row_multiple = int(np.lcm.reduce([micro // nproc, local_batch_multiple(mesh), trainer.share]))

    with jax.set_mesh(mesh):
        _, params = nnx.split(model)
        params = shard_params(params, mesh)
        # The frozen reference is the initial policy (rebuilt identically on resume).
        ref_params = jax.tree.map(jnp.copy, params) if grpo.beta > 0 else None
        opt_state = trainer.init_opt_state(params)
    ckpt = Checkpointer(os.path.join(run_dir, "ckpt"), keep=config.train.keep_checkpoints)
    start, skipped_total = 0, 0
    if ckpt.latest_step() is not None:
        params, opt_state, meta = ckpt.restore(ckpt.latest_step(), params, opt_state)
        start, skipped_total = meta["step"], meta["skipped_total"]
        print(f"resumed from step {start} ({ckpt.directory})", flush=True)

    eos = tuple(sorted({i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>"))
                        if isinstance(i, int) and i >= 0}))
    stop = build_stop_automaton(tokenizer, vocab_size=model.config.vocab_size)
    r = config.rollout
    calls = CallLog(config.train.debug_hosts)
    sampler = Sampler(model, stop, SamplingConfig(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                                  top_p=r.top_p, top_k=r.top_k, eos_ids=eos), mesh=mesh,
                      calls=calls, window_steps=r.window_steps)
    greedy = Sampler(model, stop, SamplingConfig(max_new_tokens=r.max_new_tokens, greedy=True, eos_ids=eos),
                     mesh=mesh, calls=calls, window_steps=r.window_steps)
    rcfg = RolloutConfig(group_size=g, max_searches=r.max_searches, top_k=config.retrieval.top_k,
                         max_tokens_per_passage=config.retrieval.max_tokens_per_passage)
    writer = MetricWriter(run_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    total = config.train.total_steps
    metrics: dict[str, float] = {}

    def run_eval(step):
        greedy.set_params(params)
        # Every process evaluates its share, padded to the same count (same device calls).
        n = agree_max(len(eval_set))
        padded = eval_set + [eval_set[-1]] * (n - len(eval_set))
        with jax.set_mesh(mesh):
            records = run_mode("policy", greedy, tokenizer, retriever, padded, rcfg, per_host * g,
                               config.system_prompt)[:len(eval_set)]
        scores = aggregate(sum(gather_json([{k: r[k] for k in RECORD_KEYS} for r in records]), []))
        calls.check(f"eval at step {step}")
        writer.write(step, scores, prefix="eval", total=total)
        return scores

    if config.train.eval_at_start and start == 0:
        run_eval(0)
    for step in range(start, total):
        t_step = time.perf_counter()
        # The step's global batch is the same for any number of processes; each rolls out its slice.
        examples = batch_at(train_set, step, config.data.prompts_per_step, config.seed)
        examples = examples[pid * per_host:(pid + 1) * per_host]
        if config.train.debug_hosts:
            with open(os.path.join(run_dir, f"questions.process{pid}.jsonl"), "a") as fh:
                fh.write(json.dumps({"step": step + 1, "ids": [e.id for e in examples]}) + "\n")
        prompts = [encode_prompt(tokenizer, e, config.system_prompt) for e in examples]
        sampler.set_params(params)
        with jax.set_mesh(mesh):
            t0 = time.perf_counter()
            trajs, rstats = rollout(sampler, tokenizer, retriever, prompts,
                                    jax.random.fold_in(jax.random.key(config.seed), step), rcfg)
            t_rollout = time.perf_counter() - t0
            rewards, cases, records = [], [], []
            for t in trajs:
                ex = examples[t.prompt_index]
                rew, case = reward_fn(parse_response(t.text), ex, rp)
                rewards.append(rew)
                cases.append(case)
                records.append(score_trajectory(t, ex))
            adv = group_advantages(np.array(rewards), g, eps=config.rl.adv_eps,
                                   scale_by_std=config.rl.scale_adv_by_std)
            width, response = (agree_max(f(trajs)) for f in (batch_width, response_width))
            host = build_batch(trajs, adv, micro_batch=row_multiple, pad_id=pad_id, width=width, response=response,
                               group_size=g)
            batch = {k: to_global(v, mesh) for k, v in host.items()}
            calls.record("update", batch)
            t0 = time.perf_counter()
            ref_lp = trainer.reference_logprobs(ref_params, batch)
            if ref_lp is not None:
                ref_lp.block_until_ready()
            t_ref = time.perf_counter() - t0
            t0 = time.perf_counter()
            params, opt_state, m = trainer.update(params, opt_state, batch, ref_lp)
            m = jax.device_get(m)
            t_update = time.perf_counter() - t0
        lr = float(learning_rate(optim)(step - skipped_total))  # optax counts applied updates only
        skipped_total += int(m["skipped"])
        calls.check(f"step {step + 1}")
        # Metrics over every process's trajectories.
        shares = gather_json({"rewards": rewards, "cases": cases, "adv": np.abs(adv).tolist(),
                              "records": [{k: r[k] for k in RECORD_KEYS} for r in records],
                              "sampled": int(sum(t.loss_mask.sum() for t in trajs)),
                              "train_tokens": int((host["inputs"] != pad_id).sum())})
        rewards, cases, records = (sum((x[k] for x in shares), []) for k in ("rewards", "cases", "records"))
        adv = np.array(sum((x["adv"] for x in shares), []))
        sampled, train_tokens = (sum(x[k] for x in shares) for k in ("sampled", "train_tokens"))
        dt = time.perf_counter() - t_step
        metrics = {"reward/mean": float(np.mean(rewards)), "reward/std": float(np.std(rewards)),
                   **{f"reward/case_{c}": cases.count(c) / len(cases) for c in CASES if c in cases},
                   "loss": float(m["loss"]), "lr": lr, "kl": float(m["kl"]), "entropy": float(m["entropy"]),
                   "clip_frac": float(m["clip_frac"]), "grad_norm": float(m["grad_norm"]),
                   "skipped_steps": skipped_total, "sampler_gap": float(m["sampler_gap"]),
                   "adv/abs_mean": float(np.abs(adv).mean()),
                   "tokens_per_s": sampled / max(t_rollout, 1e-9), "time/step": dt, "time/rollout": t_rollout,
                   "time/retrieval": rstats.retrieval_s, "pause_rounds": rstats.pause_rounds,
                   "retriever_calls": rstats.retriever_calls, "time/reference": t_ref, "time/update": t_update}
        metrics.update(aggregate(records))
        if config.peak_flops:
            flops = step_flops(model.config, sampled, train_tokens, ref_lp is not None)
            metrics["mfu"] = flops / dt / (config.peak_flops * jax.device_count())
        if (step + 1) % config.train.log_every == 0 or step + 1 == total:
            writer.write(step + 1, metrics, total=total)

        def save():
            ckpt.save(step + 1, params, opt_state, {"step": step + 1, "data_position":
                                                     (step + 1) * config.data.prompts_per_step,
                                                     "skipped_total": skipped_total, "seed": config.seed})
        due = (step + 1) % config.train.ckpt_every == 0 or step + 1 == total
        if due:
            save()
        if ckpt.manager.reached_preemption(step + 1):
            # TPU maintenance / spot preemption notice: save now, exit cleanly, resume on relaunch.
            if not due:
                save()
            ckpt.close()
            print(f"preemption notice: saved step {step + 1}, exiting", flush=True)
            return metrics
        if config.train.debug_kill_at_step == step + 1:
            ckpt.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        if config.train.eval_every and (step + 1) % config.train.eval_every == 0 and step + 1 != total:
            run_eval(step + 1)
    ckpt.close()
    if start < total:
        metrics.update({f"eval/{k}": v for k, v in run_eval(total).items()})
    writer.close()
    return metrics


def define_flags():
    # Defined only when run as a program: importing this module (tests, other entry points)
    # must not register a second --config.
    global _CONFIG
    _CONFIG = config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Training config file (ml_collections).",
                                              lock_config=True)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    # Orbax logs every file operation at INFO through absl; keep the console readable.
    absl_logging.set_verbosity(absl_logging.WARNING)
    initialize_distributed(_CONFIG.value.distributed)  # first: before anything starts a backend
    train(_CONFIG.value)


if __name__ == "__main__":
    define_flags()
    app.run(main)
