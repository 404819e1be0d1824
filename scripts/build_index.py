"""Build a BM25 index from a jsonl corpus, or from the data sets' own paragraphs.

    python scripts/build_index.py --corpus wiki.jsonl --out index/
    python scripts/build_index.py --musique musique_train.jsonl --hotpotqa hotpot_train.json --out index/

Corpus rows are {"id", "title", "text"} or {"id", "contents"}; broken rows are reported and
skipped; blank texts and repeated ids are refused with their counts (nothing is written). The
corpus is read in one streaming pass (memory grows with the vocabulary, not with the text), and
the index is written whole: an earlier index at --out is replaced only once the new one is
complete. Without --corpus, passages come from MuSiQue paragraphs and HotpotQA contexts (local
files or hub ids), deduplicated by title and text.
"""

import argparse
import logging
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", help="jsonl passages")
    ap.add_argument("--musique", action="append", default=[], help="MuSiQue file(s): index their paragraphs")
    ap.add_argument("--hotpotqa", action="append", default=[], help="HotpotQA file(s): index their contexts")
    ap.add_argument("--out", required=True, help="index directory to write")
    ap.add_argument("--stemmer", default="english", help="PyStemmer language, or '' for none")
    ap.add_argument("--stopwords", default="en", help="bm25s stopword list, or '' for none")
    ap.add_argument("--k1", type=float, default=1.5)
    ap.add_argument("--b", type=float, default=0.75)
    ap.add_argument("--chunk", type=int, default=20_000, help="passages tokenized at a time")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    from sem_jax.retrieval.build import CorpusError, build_index, corpus_passages
    from sem_jax.run_lock import RunLocked

    if not (args.corpus or args.musique or args.hotpotqa):
        ap.error("give --corpus, or --musique/--hotpotqa to index the data sets' paragraphs")
    if args.corpus:
        if not os.path.isfile(args.corpus):
            ap.error(f"--corpus {args.corpus}: no such file")
        passages, total, source = corpus_passages(args.corpus), None, args.corpus
    else:
        from sem_jax.data.corpus import corpus_from_datasets
        docs = corpus_from_datasets(args.musique, args.hotpotqa)
        passages, total = ((f"passage {d['id']}", d) for d in docs), len(docs)
        source = ", ".join(args.musique + args.hotpotqa)
    try:
        stats = build_index(passages, args.out, stemmer=args.stemmer or None, stopwords=args.stopwords or None,
                            k1=args.k1, b=args.b, chunk=args.chunk, total=total)
    except CorpusError as e:
        sys.exit(f"error: {source}: {e}")
    except RunLocked as e:
        sys.exit(f"error: {e}")
    print(f"indexed {stats['passages']} passages ({stats['vocabulary']} terms, {stats['postings']} postings) from "
          f"{source} into {args.out} in {stats['seconds']:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
