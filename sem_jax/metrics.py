"""Metrics out: a console progress line, TensorBoard events and metrics.jsonl (process 0 only)."""

from __future__ import annotations

import json
import os
import time

import jax


class MetricWriter:
    CONSOLE = ("reward/mean", "em", "f1", "search_ratio", "valid", "groups/tied", "kl", "grad_norm", "time/step",
               "tokens_per_s")

    def __init__(self, run_dir: str):
        self.enabled = jax.process_index() == 0
        self.start = time.time()
        if self.enabled:
            from tensorboardX import SummaryWriter
            self.tb = SummaryWriter(os.path.join(run_dir, "tb"))
            self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")

    def write(self, step: int, metrics: dict[str, float], prefix: str = "train", total: int | None = None):
        if not self.enabled:
            return
        for k, v in metrics.items():
            self.tb.add_scalar(f"{prefix}/{k}", float(v), step)
        self.tb.flush()
        self.jsonl.write(json.dumps({"step": step, "split": prefix, **{k: float(v) for k, v in metrics.items()}}) + "\n")
        self.jsonl.flush()
        shown = " ".join(f"{k.split('/')[-1] if k != 'reward/mean' else 'reward'}={metrics[k]:.4g}"
                         for k in self.CONSOLE if k in metrics)
        where = f"{step}/{total}" if total else str(step)
        print(f"[{prefix} {where} {time.time() - self.start:6.0f}s] {shown}", flush=True)

    def close(self):
        if self.enabled:
            self.tb.close()
            self.jsonl.close()
