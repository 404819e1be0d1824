"""Sampler throughput against Hugging Face `generate`, measured in one run.

    python scripts/bench_sampler.py [--out bench_sampler.json] [--repeats 3]
    JAX_PLATFORMS=cuda python scripts/bench_sampler.py --shapes qwen2.5-1.5b --dtype bfloat16
    python scripts/bench_sampler.py --model ~/.cache/sem_jax/qwen2.5-coder-0.5b-instruct

On a GPU backend both sides run on the GPU (torch on cuda).

Same random-weight Qwen2 in both (sem_jax loads the checkpoint transformers wrote), or with
--model a real checkpoint's weights at the qwen2.5-0.5b workload, same prompts, greedy and
sampled, every row generating exactly the same number of tokens (no EOS). Compile time is reported apart; timed runs follow a warm-up.
Also greedy with per-layer weights and KV cache (the CPU default) against the stacked layers
under a scan; the same greedy tokens under a 1024-token response budget, attention over a growing
window of the KV cache (the default) against the whole preallocated cache; and the cost of
pausing: the same generated tokens with 2 search pauses per row (full rollout host loop:
parse, one retriever call per round, tokenize, append-prefill). And a bound: the time the run's
weight matmuls alone take here (`matmul_floor`), so HF's time over it is the largest speedup any
sampler built on these kernels could show.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

SHAPES = {
    "tiny": dict(cfg=dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
                 batch=32, prompt=32, new=64),
    "qwen2.5-0.5b": dict(cfg=dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                  tie_word_embeddings=True),
                         batch=8, prompt=32, new=32),
    # GPU: one configs/gpu.py rollout batch (16 prompts x G=5), shorter responses.
    "qwen2.5-1.5b": dict(cfg=dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                  num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                  tie_word_embeddings=True),
                         batch=80, prompt=128, new=256),
}


LONG_BUDGET = 1024


class WordTokenizer:
    """Words and punctuation runs as ids (assigned on first sight): enough for the rollout's
    host work on a model without a tokenizer, with result blocks of realistic token counts."""

    def __init__(self, vocab_size):
        self.vocab_size, self.ids, self.words = vocab_size, {}, {}

    def encode(self, text, add_special_tokens=False):
        out = []
        for w in re.findall(r"\s*\w+|\s*[^\w\s]+|\s+", text):
            if w not in self.ids:
                i = len(self.ids) % self.vocab_size
                self.ids[w], self.words[i] = i, w
            out.append(self.ids[w])
        return out

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.words.get(int(i), " w%d" % int(i)) for i in ids)


class FixedQueryRetriever:
    """Real bm25s searches, with a fixed query (random weights write no real ones)."""

    def __init__(self):
        from sem_jax.retrieval import Retriever
        docs = [{"id": str(i), "title": f"Doc {i}", "text": f"passage {i} about topic {i % 7} and city {i % 13}"}
                for i in range(2000)]
        self.inner = Retriever.build(docs, show_progress=False)

    def search(self, queries, k):
        return self.inner.search(["topic 3 city 5"] * len(queries), k)


def _timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_floor(spec, repeats, dtype) -> float:
    """Seconds the run's weight matmuls alone take on this backend: the prefill's b x p tokens
    through every projection (LM head at the last token), then new - 1 steps of b rows through
    every projection and the LM head, with only the glue that chains them (an RMS scale per
    layer, a max over the logits); the faster of [out, in] (the sampler's copy) and [in, out]
    weights. No sampler computing these products with this backend's kernels finishes sooner."""
    import jax.numpy as jnp

    c = spec["cfg"]
    e, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = e // c["num_attention_heads"] * c["num_key_value_heads"]
    shapes = [(e, e), (kv, e), (kv, e), (e, e), (inter, e), (inter, e), (e, inter)]  # q k v o gate up down
    keys = jax.random.split(jax.random.key(0), c["num_hidden_layers"] + 1)
    head = jax.random.normal(keys[0], (vocab, e), dtype) / np.sqrt(e)
    b, p, new = spec["batch"], spec["prompt"], spec["new"]
    tokens = jax.random.normal(jax.random.key(1), (b, p, e), dtype)
    out_in_dot = lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))

    def glue(x, h, head):  # chains a step to the next through its logits
        return x + 1e-6 * jnp.max(out_in_dot(h, head), -1, keepdims=True)

    times = []
    for out_in in (True, False):
        layers = [[jax.random.normal(k, s if out_in else s[::-1], dtype) / np.sqrt(s[1])
                   for k, s in zip(jax.random.split(lk, 7), shapes)] for lk in keys[1:]]
        mm = out_in_dot if out_in else jnp.dot

        def forward(x, layers):
            for q, k, v, o, g, u, d in layers:
                x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6)
                kv_sum = jnp.sum(mm(x, k), -1, keepdims=True) + jnp.sum(mm(x, v), -1, keepdims=True)
                x = x + mm(mm(x, q), o) + 1e-6 * kv_sum
                x = x + mm(mm(x, g) * mm(x, u), d)
            return x

        # Traced and timed within this iteration, so the loop's `mm` is its own; the weights are
        # arguments (as constants, a 1.5B model's 6 GB made the GPU compile outlast the benchmark).
        @jax.jit
        def run(tokens, layers, head):  # the first token from the prefill's logits, then new - 1 steps
            x = glue(tokens[:, -1], forward(tokens.reshape(b * p, e), layers).reshape(b, p, e)[:, -1], head)
            return jax.lax.fori_loop(0, new - 1, lambda i, x: glue(x, forward(x, layers), head), x)

        run(tokens, layers, head).block_until_ready()
        times.append(_timed(lambda: run(tokens, layers, head).block_until_ready(), repeats))
    return min(times)


def real_spec(path: str) -> dict:
    """The qwen2.5-0.5b workload on the checkpoint at `path`."""
    with open(os.path.join(path, "config.json")) as fh:
        hf = json.load(fh)
    keys = SHAPES["qwen2.5-0.5b"]["cfg"]
    return dict(SHAPES["qwen2.5-0.5b"], cfg={k: hf[k] for k in keys}, path=path)


def bench_shape(name, spec, repeats, dtype, save_dir=None, quick=False):
    import torch
    import transformers

    from sem_jax.model import from_pretrained
    from sem_jax.protocol.sem import format_results
    from sem_jax.sampling import RolloutConfig, Sampler, SamplingConfig, rollout
    from sem_jax.sampling.stop import StopAutomaton

    if "path" in spec:  # real weights
        tmp = spec["path"]
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=getattr(torch, dtype)).eval()
        cfg = hf.config
    else:
        cfg = transformers.Qwen2Config(rope_theta=1e6, max_position_embeddings=4096, **spec["cfg"])
        torch.manual_seed(0)
        hf = transformers.Qwen2ForCausalLM(cfg).to(getattr(torch, dtype)).eval()
        tmp = save_dir or tempfile.mkdtemp()
        hf.save_pretrained(tmp)
    model = from_pretrained(tmp, dtype=dtype, compute_dtype=dtype)
    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    hf = hf.to(device)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()
    b, p, new = spec["batch"], spec["prompt"], spec["new"]
    prompts = np.random.RandomState(0).randint(0, cfg.vocab_size, (b, p))
    rows = {}

    never = StopAutomaton(("</search>",), np.zeros((cfg.vocab_size, 1), np.int32))
    for mode in ("greedy", "sampled"):
        scfg = SamplingConfig(max_new_tokens=new, greedy=mode == "greedy", temperature=1.0)
        sampler = Sampler(model, never, scfg)

        def run(key=jax.random.key(0)):
            state = sampler.decode(sampler.start(prompts.tolist(), 1, key))
            jax.block_until_ready(state.resp)
            assert int(state.resp_len.min()) == new

        t0 = time.perf_counter()
        run()
        compile_s = time.perf_counter() - t0
        ours = _timed(run, repeats)

        ids = torch.tensor(prompts, device=device)
        gen_kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=mode == "sampled", use_cache=True,
                      pad_token_id=0, eos_token_id=None)
        if mode == "sampled":
            gen_kw.update(temperature=1.0, top_k=0, top_p=1.0)

        def run_hf():
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), **gen_kw)
            sync()
            assert out.shape == (b, p + new)

        run_hf()  # warm-up
        theirs = _timed(run_hf, repeats)
        tokens = b * new
        rows[mode] = dict(sem_jax_tok_s=tokens / ours, hf_generate_tok_s=tokens / theirs,
                          speedup=theirs / ours, sem_jax_s=ours, hf_generate_s=theirs,
                          sem_jax_first_call_s=compile_s)
        print(f"[{name}] {mode:8s} sem_jax {tokens / ours:9.1f} tok/s | HF generate {tokens / theirs:9.1f} tok/s"
              f" | x{theirs / ours:.2f} | first call (compile) {compile_s:.1f}s", flush=True)

    # What the host's matmul kernels allow at these shapes, as a bound on any ratio to HF.
    floor = matmul_floor(spec, repeats, getattr(jax.numpy, dtype))
    bound = {mode: rows[mode]["hf_generate_s"] / floor for mode in ("greedy", "sampled")}
    rows["matmul_floor"] = dict(seconds=floor, max_speedup_greedy=bound["greedy"], max_speedup_sampled=bound["sampled"],
                                sem_jax_greedy_over_floor=rows["greedy"]["sem_jax_s"] / floor)
    print(f"[{name}] the run's weight matmuls alone: {floor:.3f}s (sem_jax greedy {rows['greedy']['sem_jax_s']:.3f}s); "
          f"no sampler built on these kernels beats HF generate by more than x{bound['greedy']:.2f} greedy, "
          f"x{bound['sampled']:.2f} sampled", flush=True)
    if quick:
        return rows

    def greedy_tok_s(budget, **sampler_kw):
        """Greedy tokens/s, every row stopped after `new` steps, of a Sampler with these options."""
        sampler = Sampler(model, never, SamplingConfig(max_new_tokens=budget, greedy=True),
                          max_steps_per_call=new, **sampler_kw)

        def run_greedy():
            state = sampler.decode(sampler.start(prompts.tolist(), 1, jax.random.key(0)))
            jax.block_until_ready(state.resp)
            assert int(state.resp_len.min()) == new

        run_greedy()
        return b * new / _timed(run_greedy, repeats)

    # Each layer's weights and KV cache as arrays of their own (the CPU default) against the
    # stacked ones under the layer scan, whose slices XLA:CPU copies at every step.
    layers = {label: greedy_tok_s(new, per_layer=pl) for label, pl in (("per_layer", True), ("stacked", False))}
    rows["layers"] = dict(per_layer_tok_s=layers["per_layer"], stacked_tok_s=layers["stacked"],
                          per_layer_speedup=layers["per_layer"] / layers["stacked"])
    print(f"[{name}] greedy, per-layer weights and cache {layers['per_layer']:9.1f} tok/s | stacked (scan) "
          f"{layers['stacked']:9.1f} tok/s | x{layers['per_layer'] / layers['stacked']:.2f}", flush=True)

    # Budgets are sized for the longest response and most rows end far sooner: the same greedy
    # tokens with a 1024-token budget, attention reading a window that grows with the text
    # (the default) against reading the whole preallocated cache.
    long = {label: greedy_tok_s(LONG_BUDGET, window_steps=ws) for label, ws in (("window", 32), ("whole_cache", 0))}
    rows["long_budget"] = dict(budget=LONG_BUDGET, window_tok_s=long["window"], whole_cache_tok_s=long["whole_cache"],
                               window_speedup=long["window"] / long["whole_cache"],
                               vs_hf_generate=long["window"] / rows["greedy"]["hf_generate_tok_s"])
    print(f"[{name}] budget {LONG_BUDGET}, {new} generated, greedy: window {long['window']:9.1f} tok/s | whole cache "
          f"{long['whole_cache']:9.1f} tok/s | x{long['window'] / long['whole_cache']:.2f} (HF generate x"
          f"{long['window'] / rows['greedy']['hf_generate_tok_s']:.2f})", flush=True)

    # Pause cost: 2 pauses per row (a counting automaton fires every `every` tokens since
    # the last resume), with the rollout's full host round each time.
    every = new // 3 + 1
    counter = np.zeros((cfg.vocab_size, every), np.int32)
    for s in range(every):
        nxt = s + 1
        counter[:, s] = (0 * 2 + 1) if nxt == every else nxt * 2
    pausing = StopAutomaton(("<every %d tokens>" % every,), counter)
    tok, retriever = WordTokenizer(cfg.vocab_size), FixedQueryRetriever()
    rcfg = RolloutConfig(group_size=1, max_searches=2, top_k=1, max_tokens_per_passage=16, max_block_tokens=512,
                         max_note_tokens=64)
    block = len(tok.encode(format_results(retriever.search(["q"], 1)[0], tok, rcfg.max_tokens_per_passage)))
    results = {}
    for label, stop, budget in (("no_pause", never, new), ("two_pauses", pausing, new + 2 * block)):
        # The budget counts inserted tokens: widen it by two blocks so both runs sample `new`.
        sampler = Sampler(model, stop, SamplingConfig(max_new_tokens=budget, greedy=True))
        info = {}

        def run_rollout():
            trajs, stats = rollout(sampler, tok, retriever, prompts.tolist(), jax.random.key(0), rcfg)
            info.update(sampled=sum(int(t.loss_mask.sum()) for t in trajs),
                        inserted=sum(int((t.loss_mask == 0).sum()) for t in trajs),
                        searches=sum(t.num_searches for t in trajs), decode_s=stats.decode_s,
                        retrieval_s=stats.retrieval_s, insert_s=stats.insert_s)

        run_rollout()
        results[label] = dict(seconds=_timed(run_rollout, repeats))
        results[label].update(info)
    overhead = results["two_pauses"]["seconds"] / results["no_pause"]["seconds"] - 1
    rows["pause"] = dict(results, overhead=overhead)
    print(f"[{name}] pauses: {results['two_pauses']['searches'] / b:.1f} per row, sampled tokens "
          f"{results['no_pause']['sampled']} vs {results['two_pauses']['sampled']}, inserted "
          f"{results['two_pauses']['inserted']}: {results['no_pause']['seconds']:.3f}s -> "
          f"{results['two_pauses']['seconds']:.3f}s, overhead {overhead * 100:.1f}% (last run: decode "
          f"{results['two_pauses']['decode_s']:.3f}s, retrieval {results['two_pauses']['retrieval_s']:.3f}s, "
          f"append-prefill {results['two_pauses']['insert_s']:.3f}s)", flush=True)
    # Both tools' weights live in this process: the peak holds both (and every sampler above).
    rows["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(f"[{name}] process peak memory {rows['peak_rss_gib']:.1f} GiB", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_sampler.json")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shapes", default="tiny,qwen2.5-0.5b", help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="weights and compute, both sides")
    ap.add_argument("--save-model", help="keep the (last shape's) random-weight HF checkpoint in this directory")
    ap.add_argument("--model", help="a local HF Qwen2 directory: its real weights instead of --shapes")
    ap.add_argument("--quick", action="store_true", help="greedy and sampled against HF generate and the matmul "
                    "bound only (no layer, budget or pause comparisons)")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(os.cpu_count() or 1)
    jax.config.update("jax_default_matmul_precision", "highest")  # f32 both sides (no TF32 on GPUs)
    torch.backends.cuda.matmul.allow_tf32 = False
    report = dict(machine=dict(platform=platform.platform(), cpus=os.cpu_count(), dtype=args.dtype,
                               jax=jax.__version__, torch=torch.__version__,
                               jax_devices=[str(d) for d in jax.devices()]),
                  results={})
    shapes = ({f"model:{os.path.basename(os.path.normpath(args.model))}": real_spec(args.model)} if args.model
              else {name: SHAPES[name] for name in args.shapes.split(",")})
    for name, spec in shapes.items():
        report["results"][name] = bench_shape(name, spec, args.repeats, args.dtype, args.save_model,
                                              args.quick)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
