"""Reading rows of user data: broken rows are counted, reported with the first example, and
skipped; no usable row at all is an error naming the source."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from tqdm import tqdm

log = logging.getLogger(__name__)
T = TypeVar("T")


def jsonl_lines(path: str, show_progress: bool = False) -> Iterator[tuple[str, str]]:
    """(\"path:line\", text) for every non-blank line."""
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(tqdm(fh, desc=f"reading {os.path.basename(path)}", unit=" rows",
                                      disable=not show_progress), start=1):
            if line.strip():
                yield f"{path}:{n}", line


def parse_rows(items: Iterable[tuple[str, Any]], parse: Callable[[Any, str], T | None], *, source: str,
               what: str = "row", limit: int | None = None) -> list[T]:
    """`parse(raw, where)` each item; ValueError/TypeError marks a broken row, None leaves a row out."""
    out: list[T] = []
    bad, left_out, first = 0, 0, None
    for where, raw in items:
        try:
            value = parse(raw, where)
        except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            bad += 1
            first = first or (str(e) if str(e).startswith(where) else f"{where}: {e}")
            continue
        if value is None:
            left_out += 1
            continue
        out.append(value)
        if limit and len(out) >= limit:
            break
    if bad:
        log.warning("%s: skipped %d broken row(s); first: %s", source, bad, first)
    if left_out:
        log.info("%s: left out %d row(s)", source, left_out)
    if not out:
        raise ValueError(f"{source}: no usable {what}" + (f" ({bad} broken; first: {first})" if bad else ""))
    return out
