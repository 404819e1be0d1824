"""Write the SEM training mix (and a held-out eval split) as sem_jax question files.

    python scripts/prepare_data.py --musique musique_ans_v1.0_train.jsonl --mmlu mmlu_auxiliary_train.parquet \
        --out data/ [--ratio 1.0] [--eval 100] [--seed 0]

Each --musique / --mmlu is a local file in the official schema or a hub id. The mix holds
`ratio` MuSiQue questions per MMLU question, shuffled with the seed; the first --eval
questions of the shuffled mix are held out as sem_eval.jsonl (the rest: sem_train.jsonl).
"""

import argparse
import dataclasses
import json
import logging
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--musique", required=True)
    ap.add_argument("--mmlu", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ratio", type=float, default=1.0, help="MuSiQue questions per MMLU question")
    ap.add_argument("--eval", type=int, default=100, help="held-out questions")
    ap.add_argument("--limit", type=int, default=None, help="questions in the mix at most")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    from sem_jax.data.mix import sem_mix
    from sem_jax.data.sources import load_source

    mix = sem_mix(load_source("musique", args.musique), load_source("mmlu", args.mmlu, split="auxiliary_train"),
                  ratio=args.ratio, seed=args.seed, limit=args.limit)
    os.makedirs(args.out, exist_ok=True)
    for name, rows in (("sem_eval.jsonl", mix[:args.eval]), ("sem_train.jsonl", mix[args.eval:])):
        with open(os.path.join(args.out, name), "w") as fh:
            for ex in rows:
                fh.write(json.dumps(dataclasses.asdict(ex)) + "\n")
        print(f"wrote {len(rows)} questions to {os.path.join(args.out, name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
