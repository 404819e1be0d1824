"""GRPO iteration time: sem_jax against TRL's GRPOTrainer, on one fixed workload, in one run.

    python scripts/bench_grpo.py [--iters 5] [--out bench_grpo.json] [--skip-trl]
    python scripts/bench_grpo.py --model ~/.cache/sem_jax/qwen2.5-coder-0.5b-instruct --iters 2

Workload (fixed so figures compare across tools): random tiny Qwen2 (vocab 8192, hidden 256,
intermediate 768, 4 layers, 4 heads, 2 KV heads, tied, rope theta 1e6), 8 prompts of 32
tokens x G = 8, exactly 64 new tokens, temperature 1.0, beta 0.04 with a reference model,
clip 0.2, AdamW lr 1e-6, global-norm clip 1.0, one optimizer step per iteration, f32.
With --model, a real HF checkpoint's weights instead, at 2 prompts x G = 4 x 32 new tokens and
beta 0 on both sides (a reference copy of 0.5B float32 weights does not fit beside AdamW's state
in 24 GB).
Both tools start from the same weights (the checkpoint transformers writes). Reported:
median seconds per iteration after one warm-up (compile time apart), split into rollout /
reference / update for sem_jax; model FLOP/s (2 x matmul params x 5 passes x tokens) against
the f32 matmul peak measured in this run, and the matmul FLOP/s sem_jax actually executes (it
prefills each prompt once per group and runs the LM head on response targets only, as TRL does),
and the process's peak resident memory after each tool (sem_jax runs first).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

CFG = dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=512)
PROMPTS, G, PROMPT_LEN, NEW = 8, 8, 32, 64
BETA = 0.04


def use_model(path: str) -> None:
    """Benchmark the checkpoint at `path` (its config), at a workload a CPU runs in minutes."""
    global PROMPTS, G, NEW, BETA
    with open(os.path.join(path, "config.json")) as fh:
        hf = json.load(fh)
    CFG.clear()
    CFG.update({k: hf[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")})
    PROMPTS, G, NEW, BETA = 2, 4, 32, 0.0


def peak_rss_gib() -> float:
    """The process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def _config():
    from sem_jax.model import Qwen2Config
    return Qwen2Config.from_hf(CFG, source="the benchmark's CFG")


def model_flops() -> float:
    """2 x matmul params x 5 passes (rollout, reference, update x 3) x tokens; 4 without a reference."""
    return 2.0 * _config().matmul_params * (5 if BETA else 4) * PROMPTS * G * (PROMPT_LEN + NEW)


def executed_flops() -> float:
    """The matmul FLOPs sem_jax runs per iteration, fewer than `model_flops` counts: each prompt
    is prefilled once for its group with the LM head at its last token only, then NEW decode steps
    over all rows; the reference and update passes (update 3x) run the layers over each group's
    shared prefix (T - R input positions, bucketed as `build_batch` does) once and over each
    row's R window positions, and the LM head over the NEW response targets only (one more
    time in the update, which recomputes the head's logits in its backward pass)."""
    from sem_jax.sampling.sampler import bucket_length
    cfg = _config()
    head = cfg.vocab_size * cfg.hidden_size
    layers = cfg.matmul_params - head
    rows = PROMPTS * G
    t, r = bucket_length(PROMPT_LEN + NEW - 1, 32), bucket_length(NEW, 32)
    rollout = PROMPTS * (PROMPT_LEN * layers + head) + NEW * rows * cfg.matmul_params
    train_layers = (PROMPTS * (t - r) + rows * r) * layers
    ref = int(BETA > 0)
    return 2.0 * (rollout + (3 + ref) * train_layers + (4 + ref) * rows * NEW * head)


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / min(times)


def bench_sem_jax(path: str, prompts: np.ndarray, iters: int) -> dict:
    from flax import nnx

    from sem_jax.model import from_pretrained
    from sem_jax.rl.batch import build_batch
    from sem_jax.rl.loss import GRPOConfig
    from sem_jax.rl.trainer import OptimConfig, Trainer
    from sem_jax.sampling import Sampler, SamplingConfig, Trajectory
    from sem_jax.sampling.stop import StopAutomaton

    model = from_pretrained(path)
    never = StopAutomaton(("</search>",), np.zeros((CFG["vocab_size"], 1), np.int32))
    sampler = Sampler(model, never, SamplingConfig(max_new_tokens=NEW, temperature=1.0))
    # LM-head chunks of 64 rows x 8 positions (16 MiB of logits): the fastest of 4..64 positions here.
    trainer = Trainer(model, GRPOConfig(beta=BETA, clip_eps=0.2),
                          OptimConfig(lr=1e-6, grad_clip=1.0, weight_decay=0.0), micro_batch=PROMPTS * G,
                          logprob_chunk=8, group_size=G)
    _, params = nnx.split(model)
    ref = jax.tree.map(jnp.copy, params) if BETA else None
    opt = trainer.init_opt_state(params)
    rng = np.random.RandomState(0)
    rows = []
    for it in range(iters + 1):
        t0 = time.perf_counter()
        sampler.set_params(params)
        state = sampler.decode(sampler.start(prompts.tolist(), G, jax.random.key(it)))
        resp, lp, n = jax.device_get((state.resp, state.resp_logprob, state.resp_len))
        assert (n == NEW).all()
        trajs = [Trajectory(r // G, prompts[r // G].tolist(), resp[r], np.ones(NEW, np.int8), lp[r], 0, [], "",
                            "length") for r in range(PROMPTS * G)]
        rewards = rng.rand(PROMPTS * G)
        adv = ((rewards.reshape(-1, G) - rewards.reshape(-1, G).mean(1, keepdims=True))
               / (rewards.reshape(-1, G).std(1, keepdims=True) + 1e-6)).reshape(-1).astype(np.float32)
        batch = build_batch(trajs, adv, micro_batch=PROMPTS * G, group_size=G)
        t1 = time.perf_counter()
        ref_lp = jax.block_until_ready(trainer.reference_logprobs(ref, batch))  # None without a reference
        t2 = time.perf_counter()
        params, opt, m = trainer.update(params, opt, batch, ref_lp)
        jax.block_until_ready(m)
        t3 = time.perf_counter()
        rows.append(dict(rollout=t1 - t0, reference=t2 - t1, update=t3 - t2, total=t3 - t0))
        print(f"  sem_jax iteration {it}: {t3 - t0:.3f}s (rollout {t1 - t0:.3f}, reference {t2 - t1:.3f}, "
              f"update {t3 - t2:.3f})", flush=True)
    timed = rows[1:]
    return dict(first_iteration_s=rows[0]["total"],
                **{f"{k}_s": statistics.median(r[k] for r in timed) for k in ("rollout", "reference", "update", "total")})


def word_tokenizer():
    """Word-level tokenizer over exactly the model's ids, so prompts are exactly PROMPT_LEN tokens;
    its EOS/pad id (vocab_size) is outside the model's logits: completions are exactly NEW tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(CFG["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")
    return out


def bench_trl(path: str, prompts: np.ndarray, iters: int) -> dict:
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    tok = word_tokenizer()
    texts = [" ".join(f"w{i}" for i in p) for p in prompts]
    assert all(len(tok(t)["input_ids"]) == PROMPT_LEN for t in texts)
    ds = datasets.Dataset.from_dict({"prompt": texts * (iters + 2)})
    model = transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    rng = np.random.RandomState(0)

    def reward(completions, **_):
        return rng.rand(len(completions)).tolist()

    times = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)
            print(f"  TRL iteration {len(times) - 1}: {times[-1]:.3f}s", flush=True)

    args = GRPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, fp16=False,
                      per_device_train_batch_size=PROMPTS * G, num_generations=G, max_completion_length=NEW,
                      temperature=1.0, top_k=0, top_p=1.0, beta=BETA, epsilon=0.2, learning_rate=1e-6,
                      max_grad_norm=1.0, weight_decay=0.0, num_iterations=1, loss_type="grpo",
                      gradient_accumulation_steps=1, max_steps=iters + 1, logging_steps=10_000,
                      save_strategy="no", report_to=[], disable_dropout=True, seed=0,
                      lr_scheduler_type="constant", dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
                          callbacks=[Clock()])
    trainer.train()
    return dict(first_iteration_s=times[0], total_s=statistics.median(times[1:]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=5, help="timed iterations after one warm-up")
    ap.add_argument("--out", default="bench_grpo.json")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--model", help="a local HF Qwen2 directory (real weights) instead of the random tiny model")
    args = ap.parse_args(argv)
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    jax.config.update("jax_default_matmul_precision", "highest")
    if args.model:
        path = args.model
        use_model(path)
    else:
        path = tempfile.mkdtemp()
        torch.manual_seed(0)
        transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CFG)).save_pretrained(path)
    prompts = np.random.RandomState(1).randint(0, CFG["vocab_size"], (PROMPTS, PROMPT_LEN))

    peak = matmul_peak()
    print(f"f32 matmul peak (2048^3, jax): {peak / 1e9:.1f} GFLOP/s", flush=True)
    ours = bench_sem_jax(path, prompts, args.iters)
    ours["peak_rss_gib"] = peak_rss_gib()
    flops = model_flops()
    report = dict(machine=dict(platform=platform.platform(), cpus=os.cpu_count(), jax=jax.__version__,
                               torch=torch.__version__),
                  workload=dict(model=CFG, checkpoint=args.model or "random", prompts=PROMPTS, group=G, prompt_len=PROMPT_LEN, new_tokens=NEW,
                                model_flops_per_iteration=flops),
                  matmul_peak_flops=peak, sem_jax=ours,
                  sem_jax_model_flops_per_s=flops / ours["total_s"],
                  sem_jax_fraction_of_peak=flops / ours["total_s"] / peak,
                  executed_flops_per_iteration=executed_flops(),
                  sem_jax_executed_fraction_of_peak=executed_flops() / ours["total_s"] / peak)
    print(f"sem_jax: {ours['total_s']:.3f} s/iteration (rollout {ours['rollout_s']:.3f}, reference "
          f"{ours['reference_s']:.3f}, update {ours['update_s']:.3f}); first iteration (compile) "
          f"{ours['first_iteration_s']:.1f}s; {flops / ours['total_s'] / 1e9:.1f} GFLOP/s = "
          f"{100 * flops / ours['total_s'] / peak:.1f}% of the matmul peak (executed: {executed_flops() / 1e9:.0f} of "
          f"{flops / 1e9:.0f} GFLOP, {100 * report['sem_jax_executed_fraction_of_peak']:.1f}% of the peak); "
          f"peak memory {ours['peak_rss_gib']:.1f} GiB", flush=True)
    if not args.skip_trl:
        import trl
        theirs = bench_trl(path, prompts, args.iters)
        report["trl"] = dict(theirs, version=trl.__version__, peak_rss_gib=peak_rss_gib())
        report["speedup_vs_trl"] = theirs["total_s"] / ours["total_s"]
        print(f"TRL GRPOTrainer: {theirs['total_s']:.3f} s/iteration -> sem_jax is "
              f"x{report['speedup_vs_trl']:.2f}; process peak memory after TRL {report['trl']['peak_rss_gib']:.1f} GiB",
              flush=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
