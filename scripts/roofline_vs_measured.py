"""Measured times beside the roofline's prediction for the same config.

    python -m sem_jax.aot --config configs/gpu.py --roofline --measure --hbm_gib 141 --json roofline.json
    python scripts/roofline_vs_measured.py roofline.json RUN_DIR/metrics.jsonl --chip H200 [--out FILE]

When the roofline's JSON holds calls measured on a device (`--measure`), their table first, set
again beside the prediction from XLA's counts and the floor from the ideal ones. Then a training
run's steps: medians over the steps after the first (which compiles), beside the predicted
step and its floor. The predicted rollout is an upper bound (every row samples its whole budget at
the full window, every search inserts); the measured one also holds the host's work (retrieval,
parsing), ends when the last row does and runs on the batch's own lengths.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from sem_jax.aot.measure import compare as compare_calls
from sem_jax.aot.measure import report as report_calls
from sem_jax.aot.roofline import CHIPS, Call, step_seconds

ROWS = (("rollout", "time/rollout"), ("update", "time/update"), ("step", "time/step"))


def compare(roofline: dict, metrics: list[dict], chip: str) -> list[tuple[str, float, float, float]]:
    """(part, measured s, predicted s, floor s) for the rollout, the update and the whole step."""
    if chip not in roofline["chips"]:
        raise ValueError(f"--chip {chip!r}: the roofline predicts {sorted(roofline['chips'])}")
    steps = [m for m in metrics if m.get("split") == "train"][1:]
    if not steps:
        raise ValueError("no training step after the first (compiling) one in the metrics")
    predicted = roofline["chips"][chip]
    floor = step_seconds([Call(**c) for c in roofline["calls"]], CHIPS[chip], Call.floor)
    floor["step"] = floor["rollout"] + floor["update"]
    return [(part, statistics.median(m[key] for m in steps), predicted[f"{part}_s"], floor[part]) for part, key in ROWS]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("roofline", help="JSON written by `python -m sem_jax.aot --roofline --json`")
    ap.add_argument("metrics", help="a run's metrics.jsonl")
    ap.add_argument("--chip", required=True, help="the roofline's chip the run ran on (e.g. H200)")
    ap.add_argument("--out", help="also write the step table here (markdown)")
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
    if "measured" in roofline:
        calls, m = [Call(**c) for c in roofline["calls"]], roofline["measured"]
        report_calls(calls, compare_calls(calls, m["runs"], args.chip, CHIPS[args.chip]),
                     f"{m['device_kind']} ({m.get('devices', 1)} device(s))")
        print(f"\na training run's steps on the batches it made, beside the roofline's for {args.chip}")
    lines = [f"| part | measured s | predicted s ({args.chip}) | measured / predicted | floor s | measured / floor |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {part} | {got:.3f} | {want:.3f} | {got / want:.2f} | {low:.3f} | {got / low:.2f} |"
              for part, got, want, low in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
