"""Metrics out: a console progress line, TensorBoard events and metrics.jsonl (process 0 only)."""

from __future__ import annotations

import json
import os
import sys
import time

import jax


def rewind_jsonl(path: str, step: int) -> int:
    """Keep the rows of `path` up to `step` (and any unreadable line, as it was); returns how many
    were dropped. A last line without its newline (a crash mid-write) is dropped when it does not
    read, else ended, so that the next row is not glued onto it. Rewritten beside it and renamed,
    so a crash here loses nothing."""
    if not os.path.exists(path):
        return 0
    with open(path) as fh:
        lines = fh.readlines()
    def after(line):
        try:
            return json.loads(line)["step"] > step
        except (ValueError, KeyError, TypeError):
            return False
    torn = bool(lines) and not lines[-1].endswith("\n")
    if torn:
        try:
            json.loads(lines[-1])
            lines[-1] += "\n"
        except ValueError:
            print(f"{path}: dropped a half-written last row ({lines[-1][:60]!r}...)", flush=True)
            lines.pop()
    keep = [line for line in lines if not after(line)]
    if len(keep) < len(lines) or torn:
        with open(path + ".tmp", "w") as fh:
            fh.writelines(keep)
        os.replace(path + ".tmp", path)
        print(f"{path}: dropped {len(lines) - len(keep)} rows after step {step} (to be redone)", flush=True)
    return len(lines) - len(keep)


def summary_writer(log_dir: str):
    """tensorboardX's SummaryWriter, imported without torch: where torch is installed,
    tensorboardX imports it only to accept its tensors (about 2 s and a few hundred MB in every
    training process); this writer logs floats."""
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX expects
    try:
        from tensorboardX import SummaryWriter
    finally:
        if blocked:
            del sys.modules["torch"]
    return SummaryWriter(log_dir)


class MetricWriter:
    CONSOLE = ("reward/mean", "em", "f1", "search_ratio", "valid", "groups/tied", "kl", "grad_norm", "time/step",
               "tokens_per_s")

    def __init__(self, run_dir: str, resumed_step: int = 0):
        """`resumed_step`: the step a run restarts from; metrics.jsonl rows after it (steps the
        crash lost, which the run is about to redo) are dropped first, so that each step is
        logged once."""
        self.enabled = jax.process_index() == 0
        self.start = time.time()
        if self.enabled:
            self.tb = summary_writer(os.path.join(run_dir, "tb"))
            path = os.path.join(run_dir, "metrics.jsonl")
            rewind_jsonl(path, resumed_step)
            self.jsonl = open(path, "a")

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

    def logged(self, step: int, split: str) -> bool:
        """Whether metrics.jsonl holds a `split` row at `step` (process 0; True elsewhere, which has
        no file to read)."""
        if not self.enabled:
            return True
        self.jsonl.flush()
        with open(self.jsonl.name) as fh:
            for line in fh:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if row.get("step") == step and row.get("split") == split:
                    return True
        return False

    def close(self):
        if self.enabled:
            self.tb.close()
            self.jsonl.close()
