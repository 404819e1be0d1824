"""Data set adapters: MuSiQue, MMLU, HotpotQA, GSM8K -> `Example`.

Each source is read through `datasets` from local files (json, jsonl, parquet, csv) or
directories in the layouts the data sets are published in, or from `hub_id[:config]` when the
argument is not a local path (and the user has network). Rows read, used and skipped (by
reason) are printed per source; a source with no usable row is an error.
"""

from __future__ import annotations

import glob
import json
import os
import re
import string
from collections.abc import Callable, Iterator
from typing import Any

from sem_jax.data.example import Example
from sem_jax.rows import LeftOut, jsonl_lines, parse_rows

MMLU_CSV_COLUMNS = ["question", "A", "B", "C", "D", "answer"]


def _need(row: dict, field: str, kind) -> Any:
    v = row.get(field)
    if v is None or not isinstance(v, kind) or (isinstance(v, str) and not v.strip()):
        raise ValueError(f"field {field!r} missing or not {getattr(kind, '__name__', kind)}")
    return v


_HOPS = re.compile(r"^(\d+)hop")


def musique(row: dict, i: int) -> Example:
    if row.get("answerable") is False:
        raise LeftOut("unanswerable")  # MuSiQue-full's unanswerable twins: not training material here
    answers = [_need(row, "answer", str)] + [a for a in row.get("answer_aliases") or [] if isinstance(a, str) and a]
    steps = row.get("question_decomposition")
    hops = _HOPS.match(str(row.get("id", "")))
    category = f"{len(steps)}hop" if isinstance(steps, (list, tuple)) and steps else (f"{hops.group(1)}hop" if hops else "")
    return Example(str(row.get("id", i)), _need(row, "question", str), tuple(answers), "musique", True,
                   category=category)


def hotpotqa(row: dict, i: int) -> Example:
    return Example(str(row.get("_id", row.get("id", i))), _need(row, "question", str),
                   (_need(row, "answer", str),), "hotpotqa", True, category=str(row.get("type") or ""))


def mmlu(row: dict, i: int) -> Example:
    if set(row) == {"train"} and isinstance(row["train"], dict):
        row = row["train"]  # the hub's auxiliary_train config nests each row under "train"
    if "choices" in row:  # hub layout: question, subject, choices, answer (index)
        choices = _need(row, "choices", (list, tuple))
        answer = row.get("answer")
        if isinstance(answer, str) and answer.strip().upper() in string.ascii_uppercase[:len(choices)]:
            letter = answer.strip().upper()
        elif isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices):
            letter = string.ascii_uppercase[answer]
        else:
            raise ValueError(f"field 'answer' is not an index or letter of the choices (got {answer!r} for "
                             f"{len(choices)} choices)")
    else:  # per-subject csv: question, A, B, C, D, answer (letter)
        choices = [_need(row, c, (str, int, float)) for c in "ABCD"]
        letter = str(_need(row, "answer", str)).strip().upper()
        if letter not in "ABCD":
            raise ValueError(f"field 'answer' is not A-D (got {letter!r})")
    opts = tuple(str(c) for c in choices)
    subject = str(row.get("subject") or "")
    return Example(str(row.get("id", f"{subject or 'mmlu'}-{i}")), _need(row, "question", str),
                   (letter,), "mmlu", False, options=opts, kind="mc", category=subject)


_GSM_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")


def gsm8k(row: dict, i: int) -> Example:
    m = _GSM_FINAL.search(_need(row, "answer", str).strip())
    if not m:
        raise ValueError("field 'answer' has no '#### N' final line")
    return Example(str(row.get("id", i)), _need(row, "question", str), (m.group(1).replace(",", ""),),
                   "gsm8k", False, kind="math")


ADAPTERS: dict[str, Callable[[dict, int], Example]] = {
    "musique": musique, "mmlu": mmlu, "hotpotqa": hotpotqa, "gsm8k": gsm8k}
EXTENSIONS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# The hub config each data set is read with when `hub_id:config` names none.
HUB_CONFIGS = {"mmlu": "all", "hotpotqa": "distractor", "gsm8k": "main"}
# MMLU's csv release names its splits by folder (data/test, data/val, data/dev, data/auxiliary_train).
CSV_SPLITS = {"validation": "val"}


def hub_config(name: str | None, config: str, split: str) -> tuple[str | None, str]:
    """(config, split) to read: the data set's usual config when none is given (MMLU all,
    HotpotQA distractor, GSM8K main); MMLU's auxiliary_train config has one split, train."""
    config = config or HUB_CONFIGS.get(name or "", "")
    if name == "mmlu" and config == "auxiliary_train":
        split = "train"
    return config or None, split


def read_rows(spec: str, split: str = "train", name: str | None = None) -> Iterator[tuple[str, Any]]:
    """(where, row) for the rows of data set `name` in `spec`: a local file (by extension); a
    directory (MMLU's csv release, or a copy of a hub repository, `dir[:config]`, whose files
    are named for their split); else a hub data set, `hub_id[:config]`. A local JSON Lines file
    is read line by line: a line that is not JSON or not UTF-8 comes as a ValueError (a broken
    row, which `parse_rows` counts and skips) instead of failing the file."""
    import datasets

    base, _, config = (spec, "", "") if os.path.exists(spec) else spec.partition(":")
    if os.path.isfile(base):
        yield from _file_rows(base)
        return
    config, split = hub_config(name, config, split)
    if os.path.isdir(base):
        for path in _split_files(base, split, config):
            yield from _file_rows(path)
        return
    try:
        ds = datasets.load_dataset(base, config, split=split)
    except Exception as e:  # no network, a wrong id, config or split: say which
        raise ValueError(f"{spec}: no such local file or directory, and the hub data set {base!r} (config "
                         f"{config!r}, split {split!r}) could not be loaded: {type(e).__name__}: {e}") from e
    for i, row in enumerate(ds):
        yield f"{spec}: row {i}", row


def _file_rows(path: str) -> Iterator[tuple[str, Any]]:
    import datasets

    ext = os.path.splitext(path)[1].lower()
    if ext not in EXTENSIONS:
        raise ValueError(f"{path}: unsupported file type {ext!r} (json, jsonl, parquet, csv)")
    if ext in (".json", ".jsonl") and not _json_array(path):
        for where, line in jsonl_lines(path):
            yield where, line if isinstance(line, ValueError) else _json_row(line)
        return
    kw, subject = {}, None
    if ext == ".csv":
        with open(path, encoding="utf-8-sig", errors="replace") as fh:
            first = fh.readline()
        if not first.lower().startswith("question"):  # MMLU's per-subject files have no header
            kw = {"column_names": MMLU_CSV_COLUMNS}
            subject = re.sub(r"_(test|val|dev)$", "", os.path.splitext(os.path.basename(path))[0])
    ds = datasets.load_dataset(EXTENSIONS[ext], data_files=path, split="train", **kw)
    for i, row in enumerate(ds):
        if subject and "subject" not in row:
            row["subject"] = subject
        yield f"{path}: row {i}", row


def _split_files(directory: str, split: str, config: str | None) -> list[str]:
    """The files of `split` in a local copy of a data set: MMLU's csv release (data/test/*.csv,
    or csv files named *_test.csv), else the hub's layout (config/split-00000-of-00001.parquet)."""
    want = CSV_SPLITS.get(split, split)
    csvs = sorted(glob.glob(os.path.join(directory, "**", "*.csv"), recursive=True))
    found = [p for p in csvs if os.path.basename(os.path.dirname(p)) == want
             or os.path.splitext(os.path.basename(p))[0].endswith(f"_{want}")]
    if not found:
        base = os.path.join(directory, config) if config and os.path.isdir(os.path.join(directory, config)) else directory
        found = sorted(p for p in glob.glob(os.path.join(base, "**", "*"), recursive=True)
                       if os.path.splitext(p)[1].lower() in EXTENSIONS
                       and re.match(rf"{re.escape(split)}([-.]|$)", os.path.basename(p)))
    if not found:
        raise ValueError(f"{directory}: no {split!r} files (looked for {want}/*.csv, *_{want}.csv and "
                         f"{config + '/' if config else ''}{split}-*.parquet|jsonl|json)")
    return found


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


def load_source(name: str, spec: str, split: str = "train", limit: int | None = None) -> list[Example]:
    """Examples of data set `name` (musique, mmlu, hotpotqa, gsm8k) from `spec` (a local file or
    directory, or `hub_id[:config]`); one line says rows read, used and skipped by reason."""
    if name not in ADAPTERS:
        raise ValueError(f"unknown data set {name!r}; choose one of {sorted(ADAPTERS)}")
    adapter = ADAPTERS[name]
    rows = ((where, row if isinstance(row, ValueError) else (i, row))
            for i, (where, row) in enumerate(read_rows(spec, split, name)))
    return parse_rows(rows, lambda item, where: adapter(item[1], item[0]), source=f"{spec} ({name})", limit=limit)
