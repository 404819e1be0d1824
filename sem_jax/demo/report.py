"""The demo's before/after table and learning curves, from the runs' metrics.jsonl.

    python -m sem_jax.demo.report runs/demo [runs/demo-research]

The first run is SEM (its step-0 evaluation is the warm start); a second, optional run is the
ReSearch baseline from the same warm start. Prints a markdown table, writes it to
<first run>/demo_table.md and the curves to <first run>/demo_curves.png.
"""

from __future__ import annotations

import json
import os
import sys

COLUMNS = (("search_ratio/known", "SR known"), ("search_ratio/unknown", "SR unknown"),
           ("em/known", "EM known"), ("em/unknown", "EM unknown"))


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: not found (did `python -m sem_jax.train --config.run_dir={run_dir}` run?)")
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def evals(rows: list[dict]) -> dict[int, dict]:
    """Evaluation rows by step (a resumed run's repeats: the last one wins)."""
    return {r["step"]: r for r in rows if r["split"] == "eval"}


def table(runs: dict[str, str]) -> tuple[str, dict[str, dict]]:
    """Markdown table: warm start (step 0 of the first run), then each run's last evaluation."""
    lines = ["| policy | " + " | ".join(name for _, name in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    picked: dict[str, dict] = {}
    for i, (label, run_dir) in enumerate(runs.items()):
        ev = evals(read_metrics(run_dir))
        if not ev:
            raise ValueError(f"{run_dir}: no evaluation rows in metrics.jsonl")
        if i == 0 and 0 in ev:
            picked["warm start"] = ev[0]
        picked[f"after {label} (step {max(ev)})"] = ev[max(ev)]
    for name, row in picked.items():
        lines.append(f"| {name} | " + " | ".join(f"{100 * row.get(key, float('nan')):.0f}%" for key, _ in COLUMNS) + " |")
    return "\n".join(lines) + "\n", picked


def smooth(values: list[float], window: int = 5) -> list[float]:
    """Trailing mean over `window` steps (a step sees only 4-8 questions of each kind)."""
    out = []
    for i in range(len(values)):
        part = [v for v in values[max(0, i + 1 - window):i + 1] if v == v]  # skip NaN
        out.append(sum(part) / len(part) if part else float("nan"))
    return out


def plot(runs: dict[str, str], out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for (label, run_dir), style in zip(runs.items(), ("-", "--", ":")):
        rows = [r for r in read_metrics(run_dir) if r["split"] == "train"]
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, smooth([r["reward/mean"] for r in rows]), style, label=label)
        for key, color in (("known", "tab:blue"), ("unknown", "tab:red")):
            for ax, metric in ((axes[1], "search_ratio"), (axes[2], "em")):
                ax.plot(steps, smooth([r.get(f"{metric}/{key}", float("nan")) for r in rows]), style, color=color,
                        label=f"{label}: {key}")
    for ax, title in zip(axes, ("reward", "search ratio", "EM")):
        title += " (train rollouts, 5-step mean)"
        ax.set_title(title)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        print(__doc__, file=sys.stderr)
        return 2
    runs = {"SEM": argv[0]}
    if len(argv) == 2 and os.path.exists(os.path.join(argv[1], "metrics.jsonl")):
        runs["ReSearch"] = argv[1]
    text, _ = table(runs)
    print(text)
    with open(os.path.join(argv[0], "demo_table.md"), "w") as fh:
        fh.write(text)
    png = os.path.join(argv[0], "demo_curves.png")
    plot(runs, png)
    print(f"learning curves: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
