"""Retrieval at Wikipedia scale: index build and search on a generated corpus, extrapolated to 21M.

    python scripts/bench_retrieval.py [--passages 1000000] [--compare 100000] [--out bench_retrieval.json]

The corpus is generated (seeded): 100-word passages (the length of DPR's Wikipedia split, 21M
passages) whose words follow a Zipf law (s = 1.07) over 300,000 word types, the commonest of
them bm25s's English stopwords, as running text has them; a title of one to three words.
Queries are 10 words drawn from a random passage's words (so each has a passage to find).

Measured in one run:
- `scripts/build_index.py` (the streaming build) on --passages: seconds, peak resident memory
  of the build process, index size on disk; and at --compare passages the same build beside
  bm25s's own in-memory build (`Retriever.build` + `save`), for the ratio of peak memory and
  time at one size;
- the index memory-mapped (`Retriever.load`): load seconds and resident memory;
- searches at the rollout's batch per host (the tpu_v4 config: 64 prompts x G = 5 rows over the 4
  hosts of v4:2x2x4 = 80 queries per search round, top 5): queries/s with one thread and with
  every core of this host, beside bm25s's own `retrieve` on the same index and queries (and
  whether the top-5 scores agree).
Extrapolated (linear in passages: BM25 scores every passage a query term touches and ranks all
passages): build time, index size and queries/s at 21M passages, and retrieval's seconds per
GRPO step per host against a rollout floor (sampled tokens x bf16 weight bytes per chip / HBM
bandwidth, 7B on 16 v4 chips): a floor, so the share it gives is an upper bound. Printed and
written to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIKI_PASSAGES = 21_000_000
# The tpu_v4 config's rollout, per host of v4:2x2x4 (16 chips, 4 per host).
PROMPTS, GROUP, HOSTS, CHIPS, TOP_K, MAX_SEARCHES, SAMPLED = 64, 5, 4, 16, 5, 2, 1024
PARAMS_7B, V4_HBM_BYTES_PER_S = 7.62e9, 1.2e12


def syllable_words(n: int) -> list[str]:
    cons, vows = "bcdfghjklmnprstvwz", "aeiou"
    syl = [c + v for c in cons for v in vows]
    words, i = [], 0
    while len(words) < n:
        j, w = i, ""
        while True:
            w += syl[j % len(syl)]
            j //= len(syl)
            if not j:
                break
        words.append(w + "n")  # a consonant end keeps the stemmer from folding words together
        i += 1
    return words


def generate(path: str, passages: int, seed: int = 0, words_per: int = 100, vocab: int = 300_000) -> None:
    from bm25s.stopwords import STOPWORDS_EN
    rng = np.random.default_rng(seed)
    stop = sorted(STOPWORDS_EN)
    words = np.array(stop + syllable_words(vocab - len(stop)))
    p = 1.0 / np.arange(1, vocab + 1) ** 1.07
    cdf = np.cumsum(p / p.sum())
    with open(path, "w") as fh:
        for start in range(0, passages, 50_000):
            n = min(50_000, passages - start)
            ids = np.searchsorted(cdf, rng.random((n, words_per)))
            titles = np.searchsorted(cdf, rng.random((n, 3)))
            for i in range(n):
                title = " ".join(words[titles[i, :1 + (i % 3)]]).title()
                fh.write(json.dumps({"id": f"doc{start + i}", "title": title, "text": " ".join(words[ids[i]])}) + "\n")


def run_measured(cmd: list[str]) -> tuple[float, float, float, str]:
    """(seconds, peak resident GiB of the child, its peak anonymous GiB, its output). The first
    counts the pages of the files it maps (the index arrays it writes: page cache the kernel can
    reclaim), the second only memory of its own, sampled every 50 ms."""
    start = time.time()
    out_file = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=out_file, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    anon = peak = 0.0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as fh:
                for line in fh:
                    if line.startswith(("RssAnon:", "VmHWM:")):
                        gib = int(line.split()[1]) / 2**20
                        anon, peak = (max(anon, gib), peak) if line[0] == "R" else (anon, max(peak, gib))
        except OSError:
            pass
        time.sleep(0.05)
    out_file.seek(0)
    out = out_file.read()
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{out[-3000:]}")
    return time.time() - start, peak, anon, out


def dir_bytes(path: str) -> dict[str, int]:
    sizes = {name: os.path.getsize(os.path.join(path, name)) for name in os.listdir(path)}
    index = sum(v for k, v in sizes.items() if k.endswith(".npy") or k == "vocab.index.json")
    return {"index_bytes": index, "corpus_bytes": sum(sizes.values()) - index, "total_bytes": sum(sizes.values())}


def rss_gib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def build(corpus: str, out: str, streaming: bool) -> dict:
    if streaming:
        cmd = [sys.executable, "scripts/build_index.py", "--corpus", corpus, "--out", out]
    else:
        cmd = [sys.executable, "-c", "import sys; from sem_jax.retrieval import Retriever; "
               "Retriever.from_jsonl(sys.argv[1], show_progress=False).save(sys.argv[2])", corpus, out]
    seconds, peak, anon, _ = run_measured(cmd)
    return {"seconds": seconds, "peak_rss_gib": peak, "peak_anon_gib": anon, **dir_bytes(out)}


def search_rate(index: str, batch: int, rounds: int, threads: int, reference: bool,
                seed: int = 1) -> dict:
    from sem_jax.retrieval import Retriever
    before = rss_gib()
    start = time.time()
    r = Retriever.load(index, threads=threads)
    load = time.time() - start
    rng = np.random.default_rng(seed)
    queries = [" ".join(rng.choice(r.corpus[int(i)]["text"].split(), 10, replace=False))
               for i in rng.integers(0, len(r), batch * rounds)]  # the index's own memory-mapped corpus
    r.search(queries[:batch], TOP_K)  # warm the page cache and bm25s's lookups
    start = time.time()
    hits = [r.search(queries[i:i + batch], TOP_K) for i in range(0, len(queries), batch)]
    seconds = time.time() - start
    found = np.mean([bool(h) for batch_hits in hits for h in batch_hits])
    out = {"threads": r.threads, "load_seconds": load, "rss_after_load_gib": rss_gib() - before,
           "queries": len(queries), "seconds": seconds, "queries_per_s": len(queries) / seconds,
           "share_with_hits": float(found)}
    if reference:  # bm25s's own search (np.add.at over every passage) on the same queries and index
        import bm25s
        import Stemmer
        tokens = bm25s.tokenize(queries, stopwords="en", stemmer=Stemmer.Stemmer("english"), return_ids=False,
                                show_progress=False)
        start = time.time()
        _, scores = r.bm25.retrieve(tokens, k=TOP_K, backend_selection="numpy", show_progress=False,
                                    n_threads=r.threads if r.threads > 1 else 0)
        out["bm25s_queries_per_s"] = len(queries) / (time.time() - start)
        ours = np.array([[p.score for p in h] + [0.0] * (TOP_K - len(h)) for b in hits for h in b])
        out["same_scores_as_bm25s"] = float(np.mean(np.all(np.isclose(ours, scores, rtol=1e-5), axis=1)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passages", type=int, default=1_000_000)
    ap.add_argument("--compare", type=int, default=100_000, help="size at which bm25s's own build is run beside")
    ap.add_argument("--rounds", type=int, default=10, help="search rounds of one batch each")
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one, removed)")
    ap.add_argument("--search-only", action="store_true",
                    help="reuse --work's corpus and index (built by an earlier run): measure the searches alone")
    ap.add_argument("--out", default="bench_retrieval.json")
    args = ap.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="bench_retrieval_")
    os.makedirs(work, exist_ok=True)
    batch = PROMPTS * GROUP // HOSTS
    report = {"host": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
              "passages": args.passages, "batch": batch, "top_k": TOP_K}
    if args.search_only and not (args.work and os.path.exists(os.path.join(work, "index", "sem_jax_index.json"))):
        ap.error("--search-only needs --work with an index an earlier run built")
    try:
        small, big = os.path.join(work, "small.jsonl"), os.path.join(work, "corpus.jsonl")
        index = os.path.join(work, "index")
        if args.search_only:
            with open(os.path.join(index, "sem_jax_index.json")) as fh:
                report["passages"] = json.load(fh)["num_docs"]
            report["search"] = search_report(index, batch, args.rounds)
            extrapolate(report)
            return write(report, args.out)
        for path, n in ((small, args.compare), (big, args.passages)):
            if not os.path.exists(path):
                start = time.time()
                generate(path, n)
                print(f"generated {n} passages ({os.path.getsize(path) / 2**30:.2f} GiB) in {time.time() - start:.0f}s",
                      flush=True)
        report["compare"] = {"passages": args.compare,
                             "streaming": build(small, os.path.join(work, "small_stream"), True),
                             "bm25s": build(small, os.path.join(work, "small_bm25s"), False)}
        c = report["compare"]
        print(f"{args.compare} passages: streaming build {c['streaming']['seconds']:.0f}s, peak "
              f"{c['streaming']['peak_anon_gib']:.2f} GiB anonymous; bm25s in memory {c['bm25s']['seconds']:.0f}s, peak "
              f"{c['bm25s']['peak_anon_gib']:.2f} GiB", flush=True)
        report["build"] = build(big, index, True)
        b = report["build"]
        print(f"{args.passages} passages: build {b['seconds']:.0f}s, peak {b['peak_anon_gib']:.2f} GiB anonymous "
              f"({b['peak_rss_gib']:.2f} GiB resident with the mapped index files), index "
              f"{b['index_bytes'] / 2**30:.2f} GiB + corpus {b['corpus_bytes'] / 2**30:.2f} GiB on disk", flush=True)
        report["search"] = search_report(index, batch, args.rounds)
        extrapolate(report)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return write(report, args.out)


def extrapolate(report: dict) -> None:
    """Linear in passages to 21M; retrieval's seconds per step per host against the rollout floor."""
    scale = WIKI_PASSAGES / report["passages"]
    qps = max(s["queries_per_s"] for s in report["search"]) / scale
    queries_per_step = report["batch"] * MAX_SEARCHES  # every row searching twice: the most a step can ask
    floor = SAMPLED * 2 * PARAMS_7B / CHIPS / V4_HBM_BYTES_PER_S
    e = report["extrapolated_21m"] = {
        "queries_per_s": qps, "retrieval_seconds_per_step": queries_per_step / qps, "rollout_floor_seconds": floor,
        "rollout_seconds_for_5_percent": queries_per_step / qps / 0.05}
    b = report.get("build")
    if b:
        e.update(build_hours=b["seconds"] * scale / 3600, index_gib=b["index_bytes"] * scale / 2**30,
                 corpus_gib=b["corpus_bytes"] * scale / 2**30)
        print(f"21M passages (x{scale:.0f}, linear): build {e['build_hours']:.1f} h, index {e['index_gib']:.0f} GiB + "
              f"corpus {e['corpus_gib']:.0f} GiB", flush=True)
    print(f"21M passages: {qps:.2f} queries/s on this host; {queries_per_step} queries per step per host = "
          f"{e['retrieval_seconds_per_step']:.1f}s of retrieval: under 5% of the rollout if the rollout takes over "
          f"{e['rollout_seconds_for_5_percent']:.0f}s (its floor: {floor:.2f}s)", flush=True)


def search_report(index: str, batch: int, rounds: int) -> list[dict]:
    runs = [search_rate(index, batch, rounds, t, reference=True) for t in (1, 0)]
    for s in runs:
        print(f"search: {s['threads']} thread(s), {s['queries_per_s']:.1f} queries/s at batch {batch}; bm25s's "
              f"own search {s['bm25s_queries_per_s']:.1f} queries/s ({s['queries_per_s'] / s['bm25s_queries_per_s']:.1f}x), "
              f"the same top-{TOP_K} scores for {100 * s['same_scores_as_bm25s']:.0f}% of queries (load "
              f"{s['load_seconds']:.1f}s, +{s['rss_after_load_gib']:.2f} GiB resident)", flush=True)
    return runs


def write(report: dict, out: str) -> int:
    with open(out, "w") as fh:
        json.dump(report, fh, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
