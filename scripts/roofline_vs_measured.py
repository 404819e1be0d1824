"""Measured step times of a training run beside the roofline's prediction for the same config.

    python -m sem_jax.aot --config configs/gpu.py --roofline --hbm_gib 141 --json roofline.json
    python scripts/roofline_vs_measured.py roofline.json RUN_DIR/metrics.jsonl --chip H200 [--out FILE]

Medians over the training steps after the first (which compiles). The predicted rollout is an
upper bound (every row samples its whole budget at the full window, every search inserts); the
measured one also holds the host's work (retrieval, parsing) and ends when the last row does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

ROWS = (("rollout", "time/rollout", "rollout_s"), ("update", "time/update", "update_s"),
        ("step", "time/step", "step_s"))


def compare(roofline: dict, metrics: list[dict], chip: str) -> list[tuple[str, float, float]]:
    """(part, measured s, predicted s) for the rollout, the update and the whole step."""
    if chip not in roofline["chips"]:
        raise ValueError(f"--chip {chip!r}: the roofline predicts {sorted(roofline['chips'])}")
    steps = [m for m in metrics if m.get("split") == "train"][1:]
    if not steps:
        raise ValueError("no training step after the first (compiling) one in the metrics")
    predicted = roofline["chips"][chip]
    return [(part, statistics.median(m[key] for m in steps), predicted[pred]) for part, key, pred in ROWS]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("roofline", help="JSON written by `python -m sem_jax.aot --roofline --json`")
    ap.add_argument("metrics", help="a run's metrics.jsonl")
    ap.add_argument("--chip", required=True, help="the roofline's chip the run ran on (e.g. H200)")
    ap.add_argument("--out", help="also write the table here (markdown)")
    args = ap.parse_args(argv)
    with open(args.roofline) as fh:
        roofline = json.load(fh)
    with open(args.metrics) as fh:
        metrics = [json.loads(line) for line in fh if line.strip()]
    try:
        rows = compare(roofline, metrics, args.chip)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lines = [f"| part | measured s | predicted s ({args.chip}) | measured / predicted |", "|---|---|---|---|"]
    lines += [f"| {part} | {got:.3f} | {want:.3f} | {got / want:.2f} |" for part, got, want in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
