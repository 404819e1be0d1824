"""Question files in sem_jax's own jsonl schema (one `Example` per row)."""

from __future__ import annotations

import json
import os

from sem_jax.data.example import Example
from sem_jax.rows import jsonl_lines, parse_rows

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
                   options=tuple(opts) if opts else None, kind=row.get("kind", "qa"),
                   category=str(row.get("category") or ""))


def load_questions(path: str) -> list[Example]:
    """Rows {id, question, answers, source, needs_search, kind, options?, category?}; broken rows are
    counted, reported with the first example, and skipped; no usable row is an error."""
    return parse_rows(jsonl_lines(path), lambda line, where: example_from_row(json.loads(line), where),
                      source=path, what="question")
