"""Question files in sem_jax's own jsonl schema (one `Example` per row)."""

from __future__ import annotations

import json
import logging
import os

from sem_jax.data.example import Example

log = logging.getLogger(__name__)
DEMO_DIR = os.path.join(os.path.dirname(__file__), "demo")


def example_from_row(row: dict, where: str) -> Example:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object")
    for field, kind in (("id", (str, int)), ("question", str), ("answers", list)):
        if not isinstance(row.get(field), kind):
            raise ValueError(f"{where}: field {field!r} missing or of the wrong type")
    opts = row.get("options")
    return Example(id=str(row["id"]), question=row["question"], answers=tuple(row["answers"]),
                   source=str(row.get("source", "unknown")), needs_search=bool(row.get("needs_search", False)),
                   options=tuple(opts) if opts else None, kind=row.get("kind", "qa"))


def load_questions(path: str) -> list[Example]:
    """Rows {id, question, answers, source, needs_search, kind, options?}; broken rows are
    counted, reported with the first example, and skipped; no usable row is an error."""
    out, bad, first = [], 0, None
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                out.append(example_from_row(json.loads(line), f"{path}:{n}"))
            except (ValueError, TypeError, json.JSONDecodeError) as e:
                bad += 1
                first = first or str(e)
    if bad:
        log.warning("%s: skipped %d broken row(s); first: %s", path, bad, first)
    if not out:
        raise ValueError(f"{path}: no usable question" + (f" ({bad} broken; first: {first})" if bad else ""))
    return out
