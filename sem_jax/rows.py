"""Reading rows of user data: every source says how many rows it read, used, left out and found
broken (by reason); broken rows are reported with the first example and skipped; no usable row
at all is an error naming the source."""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
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


class LeftOut(Exception):
    """Raised by a row parser for a well-formed row that is not used; the message is the reason
    (e.g. MuSiQue's unanswerable questions), counted apart from broken rows."""


def reason(error: Exception, where: str) -> str:
    """The kind of a row's fault, for counting: the message without its location and without
    the details in parentheses (a column, a value), which differ from row to row."""
    text, cut = str(error).removeprefix(f"{where}: "), None
    while cut != text:  # innermost parentheses first: "not JSON (Expecting ... (char 1))"
        cut, text = text, re.sub(r"\s*\([^()]*\)", "", text)
    return text.strip() or type(error).__name__


def parse_rows(items: Iterable[tuple[str, Any]], parse: Callable[[Any, str], T | None], *, source: str,
               what: str = "row", limit: int | None = None) -> list[T]:
    """`parse(raw, where)` each item; ValueError/TypeError marks a broken row (as does a raw item
    that is already a ValueError: a line that could not be read), `LeftOut` or None leaves a row
    out. One line says how many rows were read, used, left out and broken, each by reason."""
    out: list[T] = []
    read, first = 0, None
    broken: Counter[str] = Counter()
    left_out: Counter[str] = Counter()
    for where, raw in items:
        read += 1
        try:
            if isinstance(raw, ValueError):
                raise raw
            value = parse(raw, where)
        except LeftOut as e:
            left_out[str(e) or "left out"] += 1
            continue
        except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            broken[reason(e, where)] += 1
            first = first or (str(e) if str(e).startswith(where) else f"{where}: {e}")
            continue
        if value is None:
            left_out["left out"] += 1
            continue
        out.append(value)
        if limit and len(out) >= limit:
            break
    bad = sum(broken.values())
    print(f"{source}: {read} {what}s read, {len(out)} used"
          + (f", {sum(left_out.values())} left out ({by_reason(left_out)})" if left_out else "")
          + (f", {bad} broken and skipped ({by_reason(broken)})" if bad else "")
          + (f" (stopped at the limit of {limit})" if limit and len(out) >= limit else ""), flush=True)
    if bad:
        log.warning("%s: skipped %d broken row(s); first: %s", source, bad, first)
    if not out:
        raise ValueError(f"{source}: no usable {what}" + (f" ({bad} broken; first: {first})" if bad else ""))
    return out


def by_reason(counts: Counter[str], top: int = 4) -> str:
    """"3 x reason, 1 x other" for the commonest reasons."""
    items = counts.most_common()
    text = ", ".join(f"{n} x {r}" for r, n in items[:top])
    return text + (f", {sum(n for _, n in items[top:])} other" if len(items) > top else "")
