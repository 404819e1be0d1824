"""How a command ends on an error: a refusal in one paragraph, anything else with its
traceback, and in either case the process ends (no thread left to hold it)."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from absl import app

T = TypeVar("T")


class Refused(Exception):
    """A command refused what it was asked, before it changed anything; the message is the whole
    story (what, where, what to do), so it is printed without a traceback."""


def read_json(path: str, what: str) -> Any:
    """The JSON in `path`; a damaged file (not JSON, cut short, not UTF-8) is refused naming it and
    `what` it is (who writes it, what to do)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise Refused(f"{path}: damaged, not readable as JSON ({e}); it is {what}") from None


def exit_on_error(run: Callable[[], T]) -> T:
    """`run()`; if it raises, print the error and end this process at once with status 1.

    Orbax's save threads are not daemons, and after a failed save they wait for a signal that
    never comes: a normal exit would wait on them (on a pod, holding every machine). Ending the
    process also ends its part of the distributed runtime, which stops the other processes."""
    try:
        return run()
    except (Refused, app.UsageError) as e:
        print(f"refused: {e}", file=sys.stderr)
    except Exception:  # noqa: BLE001 - whatever ended the run, said once, then the process ends
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
