"""Data set adapters: MuSiQue, MMLU, HotpotQA, GSM8K -> `Example`.

Each source is read through `datasets` from local files (json, jsonl, parquet, csv) in its
official schema, or from a hub id when the argument is not a local path (and the user has
network). Broken rows are counted and reported per file with an example, then skipped; a
file with no usable row is an error.
"""

from __future__ import annotations

import json
import os
import re
import string
from collections.abc import Callable, Iterator
from typing import Any

from sem_jax.data.example import Example
from sem_jax.rows import jsonl_lines, parse_rows

MMLU_CSV_COLUMNS = ["question", "A", "B", "C", "D", "answer"]


def _need(row: dict, field: str, kind) -> Any:
    v = row.get(field)
    if v is None or not isinstance(v, kind) or (isinstance(v, str) and not v.strip()):
        raise ValueError(f"field {field!r} missing or not {getattr(kind, '__name__', kind)}")
    return v


def musique(row: dict, i: int) -> Example | None:
    if row.get("answerable") is False:
        return None  # MuSiQue-full's unanswerable twins: not training material here
    answers = [_need(row, "answer", str)] + [a for a in row.get("answer_aliases") or [] if isinstance(a, str) and a]
    return Example(str(row.get("id", i)), _need(row, "question", str), tuple(answers), "musique", True)


def hotpotqa(row: dict, i: int) -> Example:
    return Example(str(row.get("_id", row.get("id", i))), _need(row, "question", str),
                   (_need(row, "answer", str),), "hotpotqa", True)


def mmlu(row: dict, i: int) -> Example:
    if "choices" in row:  # hub layout: question, subject, choices, answer (index)
        choices = _need(row, "choices", (list, tuple))
        answer = row.get("answer")
        if isinstance(answer, str) and answer.strip().upper() in string.ascii_uppercase[:len(choices)]:
            letter = answer.strip().upper()
        elif isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices):
            letter = string.ascii_uppercase[answer]
        else:
            raise ValueError(f"field 'answer' {answer!r} is not an index or letter of {len(choices)} choices")
    else:  # per-subject csv: question, A, B, C, D, answer (letter)
        choices = [_need(row, c, (str, int, float)) for c in "ABCD"]
        letter = str(_need(row, "answer", str)).strip().upper()
        if letter not in "ABCD":
            raise ValueError(f"field 'answer' {letter!r} is not A-D")
    opts = tuple(str(c) for c in choices)
    return Example(str(row.get("id", f"{row.get('subject', 'mmlu')}-{i}")), _need(row, "question", str),
                   (letter,), "mmlu", False, options=opts, kind="mc")


_GSM_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")


def gsm8k(row: dict, i: int) -> Example:
    m = _GSM_FINAL.search(_need(row, "answer", str).strip())
    if not m:
        raise ValueError("field 'answer' has no '#### N' final line")
    return Example(str(row.get("id", i)), _need(row, "question", str), (m.group(1).replace(",", ""),),
                   "gsm8k", False, kind="math")


ADAPTERS: dict[str, Callable[[dict, int], Example | None]] = {
    "musique": musique, "mmlu": mmlu, "hotpotqa": hotpotqa, "gsm8k": gsm8k}
EXTENSIONS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def read_rows(spec: str, split: str = "train", **hub_kwargs) -> Iterator[tuple[str, Any]]:
    """(where, row) for the rows of a local file (by extension) or, when `spec` is no local path,
    a hub data set. A local JSON Lines file is read line by line: a line that is not JSON or not
    UTF-8 comes as a ValueError (a broken row, which `parse_rows` counts and skips) instead of
    failing the file."""
    import datasets

    if os.path.exists(spec):
        ext = os.path.splitext(spec)[1].lower()
        if ext not in EXTENSIONS:
            raise ValueError(f"{spec}: unsupported file type {ext!r} (json, jsonl, parquet, csv)")
        if ext in (".json", ".jsonl") and not _json_array(spec):
            for where, line in jsonl_lines(spec):
                yield where, line if isinstance(line, ValueError) else _json_row(line)
            return
        kw = {}
        if ext == ".csv":
            with open(spec, encoding="utf-8-sig", errors="replace") as fh:
                first = fh.readline()
            if not first.lower().startswith("question"):  # MMLU's per-subject files have no header
                kw = {"column_names": MMLU_CSV_COLUMNS}
        ds = datasets.load_dataset(EXTENSIONS[ext], data_files=spec, split="train", **kw)
    else:
        ds = datasets.load_dataset(spec, split=split, **hub_kwargs)
    for i, row in enumerate(ds):
        yield f"{spec}: row {i}", row


def _json_array(path: str) -> bool:
    """Whether a .json file holds one JSON array (HotpotQA's layout) rather than JSON Lines."""
    with open(path, "rb") as fh:
        head = fh.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()
    return head.startswith(b"[")


def _json_row(line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError as e:
        return ValueError(f"not JSON ({e})")


def load_source(name: str, spec: str, split: str = "train", limit: int | None = None,
                **hub_kwargs) -> list[Example]:
    """Examples of data set `name` (musique, mmlu, hotpotqa, gsm8k) from `spec`."""
    if name not in ADAPTERS:
        raise ValueError(f"unknown data set {name!r}; choose one of {sorted(ADAPTERS)}")
    adapter = ADAPTERS[name]
    rows = ((where, row if isinstance(row, ValueError) else (i, row))
            for i, (where, row) in enumerate(read_rows(spec, split, **hub_kwargs)))
    return parse_rows(rows, lambda item, where: adapter(item[1], item[0]), source=f"{spec} ({name})", limit=limit)
