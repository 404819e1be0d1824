"""Write the SEM training mix (and a held-out eval split) as sem_jax question files.

    python scripts/prepare_data.py --musique musique_ans_v1.0_train.jsonl --mmlu mmlu_auxiliary_train.parquet \
        --out data/ --tokenizer /models/Qwen2.5-7B-Instruct [--max_prompt_tokens 256] [--ratio 1.0] [--eval 100]

Each --musique / --mmlu is a local file or directory in a published layout, or a hub id with an
optional config (`cais/mmlu` reads config all, split auxiliary_train; `cais/mmlu:auxiliary_train`
its own config's nested rows). With --tokenizer,
questions whose prompt (the protocol's chat prompt) is over --max_prompt_tokens are skipped and
counted by source first (MMLU's auxiliary_train holds reading passages of thousands of tokens;
training skips them too). The mix holds `ratio` MuSiQue questions per MMLU question, shuffled with
the seed; the first --eval questions of the shuffled mix are held out as sem_eval.jsonl (the
rest: sem_train.jsonl).
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
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (the model's): skip over-long prompts")
    ap.add_argument("--max_prompt_tokens", type=int, default=256, help="the training config's data.max_prompt_tokens")
    ap.add_argument("--protocol", default="sem", help="whose chat prompt is measured (sem | research)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    from sem_jax.data.mix import sem_mix
    from sem_jax.data.sources import load_source

    musique, mmlu = load_source("musique", args.musique), load_source("mmlu", args.mmlu, split="auxiliary_train")
    if args.tokenizer:
        from sem_jax.assemble import cap_prompts
        from sem_jax.model.tokenizer import load_tokenizer
        from sem_jax.protocol import get_protocol
        tok, protocol = load_tokenizer(args.tokenizer), get_protocol(args.protocol)
        musique, mmlu = (cap_prompts(xs, protocol, protocol.system_prompt, tok, args.max_prompt_tokens, path)
                         for xs, path in ((musique, args.musique), (mmlu, args.mmlu)))
    else:
        print("prompt lengths not checked (no --tokenizer): training skips prompts over data.max_prompt_tokens")
    mix = sem_mix(musique, mmlu, ratio=args.ratio, seed=args.seed, limit=args.limit)
    if len(mix) <= args.eval or args.eval < 0:
        sys.exit(f"error: the mix holds {len(mix)} questions; --eval={args.eval} held out would leave "
                 f"{max(len(mix) - max(args.eval, 0), 0)} to train on (lower --eval, or give more questions)")
    os.makedirs(args.out, exist_ok=True)
    for name, rows in (("sem_eval.jsonl", mix[:args.eval]), ("sem_train.jsonl", mix[args.eval:])):
        with open(os.path.join(args.out, name), "w") as fh:
            for ex in rows:
                fh.write(json.dumps(dataclasses.asdict(ex)) + "\n")
        print(f"wrote {len(rows)} questions to {os.path.join(args.out, name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
