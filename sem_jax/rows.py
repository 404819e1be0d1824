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


def jsonl_lines(path: str, show_progress: bool = False) -> Iterator[tuple[str, str | ValueError]]:
    """(\"path:line\", text) for every non-blank line. A line that is not UTF-8 comes as a
    ValueError saying so (a broken row for `parse_rows`), not as an error that ends the file; a
    leading byte-order mark is dropped."""
    with open(path, "rb") as fh:
        for n, raw in enumerate(tqdm(fh, desc=f"reading {os.path.basename(path)}", unit=" rows",
                                     disable=not show_progress), start=1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                utf16 = n == 1 and raw[:2] in (b"\xff\xfe", b"\xfe\xff")
                yield f"{path}:{n}", ValueError(f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                                                + ("; the file starts as UTF-16 does: save it as UTF-8" if utf16 else ""))
                continue
            if line.strip():
                yield f"{path}:{n}", line


def parse_rows(items: Iterable[tuple[str, Any]], parse: Callable[[Any, str], T | None], *, source: str,
               what: str = "row", limit: int | None = None) -> list[T]:
    """`parse(raw, where)` each item; ValueError/TypeError marks a broken row (as does a raw item
    that is already a ValueError: a line that could not be read), None leaves a row out."""
    out: list[T] = []
    bad, left_out, first = 0, 0, None
    for where, raw in items:
        try:
            if isinstance(raw, ValueError):
                raise raw
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
