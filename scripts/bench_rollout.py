"""The rollout engine's two settings on a SEM-shaped workload, measured in one run.

    python scripts/bench_rollout.py [--out runs/bench_rollout.json] [--plot docs/rollout_search_ratio.png]
    python scripts/bench_rollout.py --shapes tiny qwen2.5-0.5b --layers 4

64 rows (8 prompts x G 8) of a random-weight Qwen2 with the real Qwen2.5 tokenizer go through 16
and through 32 decode slots, once with `rollout.lockstep` (the rows decoded in successive batches
of that many, a barrier at every search), once with the continuous engine (freed slots refilled,
searches answered on host threads while the other rows decode) and once with it and
`rollout.narrow` (once the queue is empty the decode batch halves while its rows fit in half of
it: the tail decodes its last rows, not empty slots). Random weights cannot
choose a length or a search, so each row's schedule is forced through the engine's `script`
(tokens forced at a row's sampled positions; every other token is sampled from the model): half
the rows end by EOS after 24-40 sampled tokens; half write `<search>...</search>` after 8-20 tokens
(a ~300-token result block: 3 passages of up to 96 tokens) and end 60-120 sampled tokens later,
a quarter of those searching a second time on the way. Retrievers: a bm25s index over 100k
generated passages, and the same behind a 20 ms delay per call (a remote retriever). Attention reads
the whole cache (`window_steps=0`) in every setting: with windows grown to the longest row, the
settings read windows of different sizes, whose float rounding moves a draw now and then (about one
token in 2000 on this workload; the tests check equality with windows on peaked models). Every time
is the fastest of `--repeats` runs after a warm-up run of the same configuration (compiles apart),
the three settings taking turns;
each setting's trajectories are compared with lockstep's token for token (narrowed rows decode at
other batch widths, where XLA's matmuls round differently: equal up to a draw within rounding).
Then the search ratio swept (0, 25, 50, 100% of rows) through 16 slots, every setting: the
continuous engine's time should fall with the ratio. Last, 0% and 50% with a slot for every row
(`rollout.slots = 0`, the default): lockstep is then one static batch.

    python scripts/bench_rollout.py --shapes tiny --admit 0 0.125 0.25 --passages 20000

instead sweeps `rollout.admit_share` (narrowed, the default engine) against lockstep at 0% and 50%
search through 16 slots and 0% through 32, each setting's boundaries beside its speedup.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sem_jax.data.example import Example  # noqa: E402
from sem_jax.model import Qwen2, Qwen2Config  # noqa: E402
from sem_jax.model.tokenizer import build_qwen25_tokenizer  # noqa: E402
from sem_jax.protocol import SEM  # noqa: E402
from sem_jax.retrieval import Retriever  # noqa: E402
from sem_jax.sampling import RolloutConfig, Sampler, SamplingConfig, build_stop_automaton, rollout  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2),
}
PROMPTS, G = 8, 8
IM_END = 151645
TOP_K, PASSAGE_TOKENS, BLOCK = 3, 96, 340
LOGIT_STD = 4.0


def corpus(n: int, seed: int = 0) -> list[dict[str, str]]:
    """`n` passages of 60-90 words over an invented vocabulary (entities and plain words)."""
    rng = random.Random(seed)
    syll = ["ka", "ro", "mi", "tel", "vor", "an", "si", "bel", "dur", "qua", "zen", "lo", "pri", "mu"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(2, 4))) for _ in range(20000)]
    plain = "the of and in was is a to by for with on at from as it that which".split()
    out = []
    for i in range(n):
        text = " ".join(rng.choice(plain) if rng.random() < 0.4 else rng.choice(words) for _ in range(rng.randint(60, 90)))
        out.append({"id": str(i), "title": rng.choice(words).title(), "text": text + "."})
    return out


class Delayed:
    """A remote retriever's latency: `delay` seconds per call."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay

    def search(self, queries, k):
        time.sleep(self.delay)
        return self.inner.search(queries, k)


def peaked(model) -> float:
    """Scale the (untied) LM head so the logits' spread is LOGIT_STD, and return the entropy (nats)
    of the next-token distribution. A random init's over 151936 ids is near uniform (11.9 nats),
    where float rounding between two batch layouts moves draws' inverse-CDF boundaries, ~1e-5
    apart, enough to change about one token in a few hundred; a trained model's is peaked."""
    import jax.numpy as jnp

    hidden, _ = model.hidden_states(jnp.arange(64)[None] * 2311 % 151000, cache=None)
    std = float(model.logits(hidden[0]).std())
    model.lm_head.set_value(model.lm_head[...] * (LOGIT_STD / std))
    logp = jax.nn.log_softmax(model.logits(hidden[0]), -1)
    return float(-(jnp.exp(logp) * logp).sum(-1).mean())


def workload(tok, docs, search_share: float, seed: int = 0) -> tuple[np.ndarray, dict]:
    """Each row's forced schedule [rows, S] (-1: sampled) and what it holds."""
    rng = np.random.RandomState(seed)
    rows = PROMPTS * G
    searching = set(rng.permutation(rows)[:round(search_share * rows)].tolist())
    twice = set(sorted(searching)[::4])  # a quarter of the searching rows search again
    script = np.full((rows, 256), -1, np.int32)
    sampled = []
    for r in range(rows):
        at = 0
        if r in searching:
            at = rng.randint(8, 21)
            for _ in range(2 if r in twice else 1):
                words = docs[rng.randint(len(docs))]["text"].split()[:4]
                ids = tok.encode(f"<search>{' '.join(words)}</search>", add_special_tokens=False)
                script[r, at:at + len(ids)] = ids
                at += len(ids) + rng.randint(10, 31)
            at += rng.randint(60, 121)
        else:
            at = rng.randint(24, 41)
        script[r, at - 1] = IM_END
        sampled.append(at)
    return script, dict(search_rows=len(searching), twice=len(twice), sampled_tokens=int(sum(sampled)))


def engine_config(slots: int, **extra) -> RolloutConfig:
    return RolloutConfig(group_size=G, max_searches=2, top_k=TOP_K, max_tokens_per_passage=PASSAGE_TOKENS,
                         max_block_tokens=BLOCK, max_note_tokens=32, slots=slots, **extra)


SETTINGS = {"lockstep": dict(lockstep=True), "continuous": dict(narrow=False), "narrowed": dict(narrow=True)}


def run(sampler, tok, retriever, prompts, script, cfgs: dict[str, RolloutConfig], repeats: int) -> dict:
    """Each setting's (seconds, trajectories, stats): the fastest of `repeats` timed runs after a
    warm-up run (compiles), the settings taking turns so that a slow spell of the machine falls
    on all of them."""
    for cfg in cfgs.values():
        rollout(sampler, tok, retriever, prompts, jax.random.key(0), cfg, SEM, script=script)
    best = {name: (float("inf"), None, None) for name in cfgs}
    for _ in range(repeats):
        for name, cfg in cfgs.items():
            t0 = time.perf_counter()
            trajs, stats = rollout(sampler, tok, retriever, prompts, jax.random.key(0), cfg, SEM, script=script)
            best[name] = min(best[name][0], time.perf_counter() - t0), trajs, stats
    return best


def admit_sweep(sampler, tok, retriever, prompts, docs, shares: list[float], repeats: int) -> dict:
    """Lockstep and the default engine at each `admit_share`, taking turns (fastest of `repeats`)."""
    rows = {}
    for search, slots in ((0.0, 16), (0.5, 16), (0.0, 32)):
        script, info = workload(tok, docs, search)
        cfgs = {"lockstep": engine_config(slots, lockstep=True),
                **{f"admit_share={a}": engine_config(slots, admit_share=a) for a in shares}}
        best = {name: (t, stats) for name, (t, _, stats) in
                run(sampler, tok, retriever, prompts, script, cfgs, repeats).items()}
        lock = best.pop("lockstep")[0]
        key = f"share={search} slots={slots}"
        rows[key] = dict(search_share=search, slots=slots, **info, lockstep_s=lock,
                         settings={name: dict(seconds=t, speedup=lock / t, boundaries=st.boundaries,
                                              decode_steps=st.decode_steps, occupancy=st.occupancy)
                                   for name, (t, st) in best.items()})
        print(f"{key}: lockstep {lock:.2f}s | " + " | ".join(
            f"{name} {t:.2f}s x{lock / t:.2f}, {st.boundaries} boundaries, {st.decode_steps} steps"
            for name, (t, st) in best.items()), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["tiny", "qwen2.5-0.5b"], choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=4, help="layers of the qwen2.5-0.5b shape (24 in the model)")
    ap.add_argument("--passages", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per setting (their fastest is kept)")
    ap.add_argument("--out", default="runs/bench_rollout.json")
    ap.add_argument("--plot", default="docs/rollout_search_ratio.png")
    ap.add_argument("--admit", nargs="+", type=float, metavar="SHARE",
                    help="sweep rollout.admit_share (tiny shape only) instead of the settings")
    args = ap.parse_args()
    from flax import nnx

    tok = build_qwen25_tokenizer()
    t0 = time.perf_counter()
    docs = corpus(args.passages)
    bm25 = Retriever.build(docs, show_progress=False)
    print(f"index: {len(docs)} passages in {time.perf_counter() - t0:.1f}s", flush=True)
    retrievers = {"bm25s": bm25, "bm25s+20ms": Delayed(bm25, 0.020)}
    prompts = [SEM.encode_prompt(tok, Example(str(i), f"Which river runs through the city where {docs[i]['title']} was "
                                                     "founded?", ("x",), "synthetic", True)) for i in range(PROMPTS)]
    stop = build_stop_automaton(tok, SEM.stop_strings)
    result = dict(device=str(jax.devices()[0]), platform=platform.platform(), processor=platform.processor(),
                  jax=jax.__version__, rows=PROMPTS * G, group_size=G, repeats=args.repeats, shapes={})
    for shape in args.shapes:
        dims = dict(SHAPES[shape])
        if shape != "tiny":
            dims["num_layers"] = args.layers
        model = Qwen2(Qwen2Config(vocab_size=151936, rope_theta=1e6, tie_word_embeddings=False, **dims), rngs=nnx.Rngs(0))
        entropy = peaked(model)
        print(f"[{shape}] next-token entropy {entropy:.2f} nats", flush=True)
        sampler = Sampler(model, stop, SamplingConfig(max_new_tokens=256, eos_ids=(IM_END,),
                                                      max_inserted_tokens=2 * BLOCK), window_steps=0)
        if args.admit:
            result["shapes"][shape] = dict(config=dims, entropy_nats=entropy,
                                           admit=admit_sweep(sampler, tok, bm25, prompts, docs, args.admit, args.repeats))
            continue
        rows = {}
        sweeps = [(0.5, slots, name) for slots in (16, 32)
                  for name in (retrievers if shape == "tiny" else ["bm25s"])]
        sweeps += [(share, 16, "bm25s") for share in (0.0, 0.25, 1.0)] if shape == "tiny" else []
        sweeps += [(share, PROMPTS * G, "bm25s") for share in (0.0, 0.5)] if shape == "tiny" else []  # the default
        for share, slots, name in sweeps:
            script, info = workload(tok, docs, share)
            cfgs = {setting: engine_config(slots, **extra) for setting, extra in SETTINGS.items()}
            (lt, lock, ls), (ct, cont, cs), (nt, narrow, ns) = run(
                sampler, tok, retrievers[name], prompts, script, cfgs, args.repeats).values()
            same = lambda got: sum(a.response_ids.tolist() == b.response_ids.tolist() for a, b in zip(lock, got))
            logp = lambda got: max(float(np.abs(a.logprobs - b.logprobs).max()) for a, b in zip(lock, got)
                                   if len(a.logprobs) == len(b.logprobs))
            key = f"share={share} slots={slots} {name}"
            # Occupancy: active slot-steps over the slot-steps decoded (narrowed: over the narrower
            # widths of the tail; "of the slots": over its decode steps x the configured slots).
            rows[key] = dict(search_share=share, slots=slots, retriever=name, **info, lockstep_s=lt, continuous_s=ct,
                             speedup=lt / ct, narrowed_s=nt, narrowed_speedup=lt / nt,
                             lockstep_occupancy=ls.occupancy, continuous_occupancy=cs.occupancy,
                             narrowed_occupancy=ns.occupancy,
                             narrowed_occupancy_of_slots=ns.active_slot_steps / (ns.decode_steps * slots),
                             narrowings=ns.narrowed, lockstep_steps=ls.decode_steps, continuous_steps=cs.decode_steps,
                             narrowed_steps=ns.decode_steps, continuous_prefills=cs.prefills,
                             retrieval_hidden_s=cs.retrieval_hidden_s, retrieval_wait_s=cs.retrieval_wait_s,
                             identical_tokens=same(cont) == len(lock), max_logprob_diff=logp(cont),
                             narrowed_identical_rows=same(narrow), narrowed_max_logprob_diff=logp(narrow))
            print(f"[{shape}] {key}: lockstep {lt:.2f}s (occupancy {ls.occupancy:.0%}, {ls.decode_steps} steps) | "
                  f"continuous {ct:.2f}s (occupancy {cs.occupancy:.0%}, {cs.decode_steps} steps, {cs.prefills} prefills) "
                  f"x{lt / ct:.2f}, identical rows {same(cont)}/{len(lock)} | narrowed {nt:.2f}s (occupancy "
                  f"{ns.occupancy:.0%}, of the slots {rows[key]['narrowed_occupancy_of_slots']:.0%}, {ns.narrowed} "
                  f"narrowings) x{lt / nt:.2f}, identical rows {same(narrow)}/{len(lock)} "
                  f"(logprob diff {logp(narrow):.1e})", flush=True)
        result["shapes"][shape] = dict(config=dims, entropy_nats=entropy, rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"wrote {args.out}")
    if "tiny" in result["shapes"] and args.plot and not args.admit:
        plot(result["shapes"]["tiny"]["rows"], args.plot)


def plot(rows: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = sorted((r for r in rows.values() if r["slots"] == 16 and r["retriever"] == "bm25s"),
                   key=lambda r: r["search_share"])
    x = [100 * r["search_share"] for r in sweep]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.plot(x, [r["lockstep_s"] for r in sweep], "o-", label="lockstep")
    ax.plot(x, [r["continuous_s"] for r in sweep], "o-", label="continuous")
    ax.plot(x, [r["narrowed_s"] for r in sweep], "o-", label="continuous, narrowed")
    ax.set_xlabel("rows that search (%)")
    ax.set_ylabel("rollout seconds")
    ax.set_title("64 rows through 16 slots (tiny model, CPU)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
