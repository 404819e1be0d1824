"""Build a BM25 index from a jsonl corpus.

    python scripts/build_index.py --corpus wiki.jsonl --out index/

Rows are {"id", "title", "text"} or {"id", "contents"}; broken rows are reported and skipped.
"""

import argparse
import logging
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, help="jsonl passages")
    ap.add_argument("--out", required=True, help="index directory to write")
    ap.add_argument("--stemmer", default="english", help="PyStemmer language, or '' for none")
    ap.add_argument("--stopwords", default="en", help="bm25s stopword list, or '' for none")
    ap.add_argument("--k1", type=float, default=1.5)
    ap.add_argument("--b", type=float, default=0.75)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    from sem_jax.retrieval import Retriever, read_corpus

    start = time.time()
    docs = read_corpus(args.corpus)
    retriever = Retriever.build(docs, stemmer=args.stemmer or None, stopwords=args.stopwords or None,
                                k1=args.k1, b=args.b)
    retriever.save(args.out)
    print(f"indexed {len(docs)} passages from {args.corpus} into {args.out} in {time.time() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
