"""A directory written whole or not at all: built under a scratch name of the program's own
(unique, hidden, beside the target), then swapped into place. Only names this module made are
ever deleted: a user's `OUT.old` or `OUT.partial` is never touched."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

TAG = "sem_jax"  # in every scratch name: `.OUT.partial-sem_jax-XXXX`, `.OUT.old-sem_jax-XXXX`


def scratch_beside(out: str, what: str = "partial") -> str:
    """A new empty directory beside `out`, named for it and unique (`tempfile.mkdtemp`)."""
    parent, name = os.path.split(os.path.abspath(out.rstrip("/")))
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(dir=parent, prefix=f".{name}.{what}-{TAG}-")


@contextlib.contextmanager
def writing(out: str) -> Iterator[str]:
    """A scratch directory beside `out` to write into: swapped into place when the block ends,
    deleted (and `out` left as it was) when it raises."""
    scratch = scratch_beside(out)
    try:
        yield scratch
        swap_into_place(scratch, out)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise


def swap_into_place(scratch: str, out: str) -> None:
    """Put the finished `scratch` at `out`; an `out` already there is moved to a scratch name of
    its own first and deleted only once the new one is in place."""
    out = os.path.abspath(out.rstrip("/"))
    if not os.path.exists(out):
        os.rename(scratch, out)
        return
    old = scratch_beside(out, "old")
    os.rename(out, old)  # onto the empty directory mkdtemp made: it is replaced
    os.rename(scratch, out)
    shutil.rmtree(old)
