"""A GRPO step with LoRA on the top layers against the full fine-tune, on a real checkpoint, in one run.

    python scripts/bench_lora.py --model ~/.cache/sem_jax/qwen2.5-coder-0.5b-instruct [--iters 2]

Workload: configs/real_experiment.py:cpu's step shape (PROMPTS prompts x G rows, PROMPT_LEN prompt
tokens, exactly NEW sampled tokens; random token ids: the time does not depend on the text), f32,
beta > 0 with a reference pass, AdamW, global-norm clip, the trainer's micro-batch. Three settings:
LoRA as training runs it (the sampler keeps the residual stream entering the lowest adapted layer,
and the reference pass and the update start there), LoRA with the update over every layer (the
frozen ones forward only), and the full fine-tune. Each runs in a process of its own (its peak
resident memory is its own), one warm-up iteration (compiling) then `--iters` timed ones; reported:
median seconds of the rollout (the sampler on the policy's merged weights), the reference pass, the
update, the two together (after the rollout) and the whole step, the peak memory, and the ratios.
Written to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

PROMPTS, G, PROMPT_LEN, NEW, MICRO = 4, 4, 320, 192, 8  # MICRO: the :cpu config's micro-batch
BETA = 0.001


def one_setting(path: str, rank: int, layers: int, iters: int, args_full_forward: bool = False,
                beta: float = BETA, micro: int = MICRO) -> dict:
    """This process's timings for one setting (rank 0: the full fine-tune; `args_full_forward`:
    LoRA without the sampler's residual stream, the update running every layer)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from sem_jax.model import from_pretrained
    from sem_jax.model import lora as lora_lib
    from sem_jax.rl.batch import build_batch
    from sem_jax.rl.loss import GRPOConfig
    from sem_jax.rl.trainer import OptimConfig, Trainer
    from sem_jax.sampling import Sampler, SamplingConfig, Trajectory
    from sem_jax.sampling.stop import StopAutomaton

    model = from_pretrained(path)
    cfg = model.config
    spec = lora_lib.LoraSpec(rank=rank, alpha=2.0 * rank, targets=tuple(lora_lib.TARGETS), first=cfg.num_layers - layers,
                             num_layers=cfg.num_layers) if rank else None
    never = StopAutomaton(("</search>",), np.zeros((cfg.vocab_size, 1), np.int32))
    # As training runs it: the sampler keeps the residual entering the lowest adapted layer.
    sampler = Sampler(model, never, SamplingConfig(max_new_tokens=NEW, temperature=1.0),
                      resid_layer=spec.first if spec and not args_full_forward else -1)
    trainer = Trainer(model, GRPOConfig(beta=beta, clip_eps=0.2), OptimConfig(lr=1e-5, grad_clip=1.0),
                      micro_batch=micro, group_size=G, lora=spec)
    _, params = nnx.split(model)
    del model
    if spec:
        base, ref = params, params
        params = lora_lib.init_adapters(spec, cfg)
    else:
        base, ref = None, jax.tree.map(jnp.copy, params) if beta else None
    opt = trainer.init_opt_state(params)
    prompts = np.random.RandomState(1).randint(0, cfg.vocab_size - 1000, (PROMPTS, PROMPT_LEN))
    rng = np.random.RandomState(0)
    rows = []
    for it in range(iters + 1):
        t0 = time.perf_counter()
        sampler.set_params(params if spec is None else lora_lib.merge(spec, base, params))
        state = sampler.decode(sampler.start(prompts.tolist(), G, jax.random.key(it)))
        resp, lp, n = jax.device_get((state.resp, state.resp_logprob, state.resp_len))
        resid = None if state.cache.resid is None else np.asarray(state.cache.resid)
        sampler.release()
        trajs = [Trajectory(r // G, prompts[r // G].tolist(), resp[r][:n[r]], np.ones(n[r], np.int8), lp[r][:n[r]], 0,
                            [], "", "length",
                            resid=None if resid is None else resid[r, :PROMPT_LEN + n[r] - 1].copy())
                 for r in range(PROMPTS * G)]
        adv = rng.randn(PROMPTS * G).astype(np.float32)
        batch = build_batch(trajs, adv, micro_batch=micro, group_size=G)
        t1 = time.perf_counter()
        ref_lp = jax.block_until_ready(trainer.reference_logprobs(ref, batch))
        t2 = time.perf_counter()
        params, opt, m = trainer.update(params, opt, batch, ref_lp, base=base)
        jax.block_until_ready(m)
        t3 = time.perf_counter()
        rows.append(dict(rollout=t1 - t0, reference=t2 - t1, update=t3 - t2, total=t3 - t0))
        print(f"  rank {rank} iteration {it}: {t3 - t0:.2f}s (rollout {t1 - t0:.2f}, reference {t2 - t1:.2f}, "
              f"update {t3 - t2:.2f}); grad_norm {float(m['grad_norm']):.3g}", file=sys.stderr, flush=True)
    timed = rows[1:]
    out = {f"{k}_s": statistics.median(r[k] for r in timed) for k in ("rollout", "reference", "update", "total")}
    out["after_rollout_s"] = out["reference_s"] + out["update_s"]
    out["first_iteration_s"] = rows[0]["total"]
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    out["trained_parameters"] = int(sum(x.size for x in jax.tree.leaves(params)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a local HF Qwen2 directory")
    ap.add_argument("--iters", type=int, default=2, help="timed iterations after one warm-up")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4, help="top layers with adapters")
    ap.add_argument("--out", default="bench_lora.json")
    ap.add_argument("--beta", type=float, default=BETA, help="KL coefficient (0: no reference pass or copy)")
    ap.add_argument("--micro", type=int, default=MICRO,
                    help="rows a micro-batch, every setting (the full fine-tune fits 24 GiB only below the default)")
    ap.add_argument("--settings", default="lora,lora_full_forward,full", help="which settings to run")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # "rank,layers,full_forward": one setting here, its JSON
    args = ap.parse_args(argv)
    if args.one:
        rank, layers, full_forward = map(int, args.one.split(","))
        print(json.dumps(one_setting(args.model, rank, layers, args.iters, bool(full_forward), args.beta, args.micro)))
        return 0
    results = {}
    wanted = args.settings.split(",")
    for name, rank, full_forward in (("lora", args.rank, 0), ("lora_full_forward", args.rank, 1), ("full", 0, 0)):
        if name not in wanted:
            continue
        print(f"{name} (rank {rank}, top {args.layers} layers)" if rank else name, flush=True)
        proc = subprocess.run([sys.executable, __file__, "--model", args.model, "--iters", str(args.iters),
                               "--beta", str(args.beta), "--micro", str(args.micro), "--one", f"{rank},{args.layers},{full_forward}"],
                              stdout=subprocess.PIPE, text=True)
        if proc.returncode:  # killed for memory, say: recorded, the other settings still run
            results[name] = {"failed": f"exit {proc.returncode}"}
            print(f"  failed: exit {proc.returncode}", flush=True)
            continue
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"  {json.dumps(results[name])}", flush=True)
    ok = {k: v for k, v in results.items() if "failed" not in v}
    ratios = {}
    if "full" in ok and "lora" in ok:
        full, lora = ok["full"], ok["lora"]
        ratios = {k: full[f"{k}_s"] / lora[f"{k}_s"] for k in ("after_rollout", "update", "total")}
        print(f"full fine-tune / LoRA: after the rollout x{ratios['after_rollout']:.2f}, whole step "
              f"x{ratios['total']:.2f}; peak memory {full['peak_rss_gib']:.1f} vs {lora['peak_rss_gib']:.1f} GiB",
              flush=True)
    if "lora_full_forward" in ok and "lora" in ok:
        ratios["residual_vs_full_forward_after_rollout"] = (ok["lora_full_forward"]["after_rollout_s"]
                                                            / ok["lora"]["after_rollout_s"])
    report = dict(machine=dict(platform=platform.platform(), cpus=os.cpu_count()),
                  workload=dict(checkpoint=args.model, prompts=PROMPTS, group=G, prompt_len=PROMPT_LEN, new_tokens=NEW,
                                micro_batch=args.micro, beta=args.beta, lora_rank=args.rank, lora_layers=args.layers),
                  **results, speedup=ratios)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
