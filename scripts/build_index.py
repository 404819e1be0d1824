"""Build a BM25 index from a jsonl corpus, or from the data sets' own paragraphs.

    python scripts/build_index.py --corpus wiki.jsonl --out index/
    python scripts/build_index.py --musique musique_train.jsonl --hotpotqa hotpot_train.json --out index/

Corpus rows are {"id", "title", "text"} or {"id", "contents"}; broken rows are reported and
skipped. Without --corpus, passages come from MuSiQue paragraphs and HotpotQA contexts,
deduplicated by title and text.
"""

import argparse
import logging
import sys
import time


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
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    from sem_jax.retrieval import Retriever, read_corpus

    if not (args.corpus or args.musique or args.hotpotqa):
        ap.error("give --corpus, or --musique/--hotpotqa to index the data sets' paragraphs")
    start = time.time()
    if args.corpus:
        docs = read_corpus(args.corpus)
    else:
        from sem_jax.data.corpus import corpus_from_datasets
        docs = corpus_from_datasets(args.musique, args.hotpotqa)
    retriever = Retriever.build(docs, stemmer=args.stemmer or None, stopwords=args.stopwords or None,
                                k1=args.k1, b=args.b)
    retriever.save(args.out)
    source = args.corpus or ", ".join(args.musique + args.hotpotqa)
    print(f"indexed {len(docs)} passages from {source} into {args.out} in {time.time() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
