"""The experiment's table and curves: OUT/report.md, report.json and curves.png.

Rows are policies x evaluation modes; columns EM, F1 and SR per data set (MMLU and GSM8K known,
the multi-hop world unknown), as the paper's tables. The goal's checks compare the trained
policies with the warm start in `policy` mode.
"""

from __future__ import annotations

import json
import math
import os

from sem_jax.demo.report import read_metrics, smooth
from sem_jax.errors import read_json
from sem_jax.evaluate import results_table

KNOWN, UNKNOWN = "mmlu", "multihop"
CURVES = (("reward/mean", "reward"), ("search_ratio/known", "SR known"), ("search_ratio/unknown", "SR unknown"),
          ("em", "EM"), ("valid", "valid share"), ("response_tokens", "response tokens"))


def read_results(out: str, policies: list[str]) -> dict[str, dict]:
    """policy -> mode -> data set -> scores, for the policies evaluated so far."""
    found = {}
    for name in policies:
        path = os.path.join(out, "eval", name, "results.json")
        if os.path.exists(path):
            found[name] = read_json(path, f"the {name} policy's evaluation: delete eval/{name} and run the "
                                          "experiment again to redo it")
    return found


def goal_checks(results: dict[str, dict]) -> dict[str, dict]:
    """The issue's goal, each check with its numbers (percentage points), where its policies ran."""
    get = lambda p, d, k: results.get(p, {}).get("policy", {}).get(d, {}).get(k, math.nan)
    warm_sr_known, sem_sr_known = get("warm", KNOWN, "search_ratio"), get("sem", KNOWN, "search_ratio")
    checks = {  # name -> (value, the bound it must reach, whether it must pass it strictly)
        "SR on known falls by >= 30 points": (100 * (warm_sr_known - sem_sr_known), 30.0, False),
        "SR on unknown stays >= 80%": (100 * get("sem", UNKNOWN, "search_ratio"), 80.0, False),
        "EM on unknown rises": (100 * (get("sem", UNKNOWN, "em") - get("warm", UNKNOWN, "em")), 0.0, True),
        "ReSearch's SR on known >= SEM's + 30 points": (100 * (get("research", KNOWN, "search_ratio") - sem_sr_known),
                                                         30.0, False),
    }
    return {name: {"value": round(v, 2), "needs": f"{'>' if strict else '>='} {need:g}",
                   "met": None if v != v else bool(v > need if strict else v >= need)}
            for name, (v, need, strict) in checks.items()}


def markdown(results: dict[str, dict], checks: dict[str, dict], datasets: list[str], note: str) -> str:
    rows = {f"{policy} / {mode}": per for policy, modes in results.items() for mode, per in modes.items()}
    lines = [note, "", results_table(rows, datasets), "| goal | value | needs | met |", "|---|---|---|---|"]
    for name, c in checks.items():
        lines.append(f"| {name} | {c['value']} | {c['needs']} | {'-' if c['met'] is None else c['met']} |")
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, str], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for (label, run_dir), style in zip(runs.items(), ("-", "--")):
        if not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
            continue
        rows = [r for r in read_metrics(run_dir) if r["split"] == "train"]
        steps = [r["step"] for r in rows]
        for ax, (key, title) in zip(axes.flat, CURVES):
            ax.plot(steps, smooth([r.get(key, math.nan) for r in rows]), style, label=label)
            ax.set_title(f"{title} (train rollouts, 5-step mean)", fontsize=9)
    for ax in axes.flat:
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: str, policies: list[str], runs: dict[str, str], datasets: list[str], note: str,
                 show: bool = True) -> dict:
    """report.md, report.json and curves.png in `out`, from what has run (printed if `show`);
    returns report.json's content."""
    results = read_results(out, policies)
    checks = goal_checks(results)
    text = markdown(results, checks, datasets, note)
    report = {"note": note, "results": results, "goal": checks}
    for name, content in (("report.md", text), ("report.json", json.dumps(report, indent=1))):
        with open(os.path.join(out, name), "w") as fh:
            fh.write(content)
    plot(runs, os.path.join(out, "curves.png"))
    if show:
        print(text, flush=True)
    return report
