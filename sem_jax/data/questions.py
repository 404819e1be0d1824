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
    if opts is not None and not (isinstance(opts, list) and all(isinstance(o, str) for o in opts)):
        raise ValueError(f"{where}: field 'options' must be a list of strings")
    return Example(id=str(row["id"]), question=row["question"], answers=tuple(row["answers"]),
                   source=str(row.get("source", "unknown")), needs_search=flag(row.get("needs_search", False), where),
                   options=tuple(opts) if opts else None, kind=row.get("kind", "qa"),
                   category=str(row.get("category") or ""))


def question_row(e: Example) -> dict:
    """`e` as a row of this schema: what `example_from_row` reads back as `e`."""
    row = {"id": e.id, "question": e.question, "answers": list(e.answers), "source": e.source,
           "needs_search": e.needs_search, "kind": e.kind, "category": e.category}
    if e.options:
        row["options"] = list(e.options)
    return row


FLAGS = {"true": True, "1": True, "false": False, "0": False}


def flag(value, where: str, field: str = "needs_search") -> bool:
    """A JSON boolean, 0/1, or the strings true/false/0/1 (any case); anything else is a broken
    row (`bool("false")` is True)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in FLAGS:
        return FLAGS[value.strip().lower()]
    raise ValueError(f"{where}: field {field!r} is not true or false ({value!r})")


def load_questions(path: str) -> list[Example]:
    """Rows {id, question, answers, source, needs_search, kind, options?, category?}; broken rows are
    counted, reported with the first example, and skipped; no usable row is an error. An id seen
    before is a broken row (evaluation records and samples are keyed by id)."""
    first_at: dict[str, str] = {}

    def parse(line: str, where: str) -> Example:
        ex = example_from_row(json.loads(line), where)
        if ex.id in first_at:
            raise ValueError(f"{where}: duplicate id ({ex.id!r}, first at {first_at[ex.id]})")
        first_at[ex.id] = where
        return ex
    return parse_rows(jsonl_lines(path), parse, source=path, what="question")
