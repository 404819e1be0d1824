"""One trainer per run directory: an advisory lock on `run_dir/.lock`, held while training.

The kernel drops the lock when its holder dies, however it dies, so a lock left by a killed run
is taken over (and said so); a live holder is named (host, pid, since when) in the refusal.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket


class RunLocked(RuntimeError):
    pass


class RunLock:
    """`RunLock(run_dir)`: one trainer per run directory. `RunLock.beside(out, job)`: one `job` per
    output that is written elsewhere and renamed into place (an index build's `out`)."""

    def __init__(self, run_dir: str, *, path: str | None = None,
                 holder: str = "another trainer holds this run directory",
                 advice: str = "stop it, or give this run its own run_dir"):
        self.path = path or os.path.join(run_dir, ".lock")
        self.holder, self.advice = holder, advice
        self.fd: int | None = None

    @classmethod
    def beside(cls, out: str, job: str) -> "RunLock":
        """A lock on `out.lock`, beside `out` (which may not exist yet)."""
        out = os.path.abspath(out).rstrip("/")
        return cls(os.path.dirname(out), path=out + ".lock", holder=f"another {job} writes {out}",
                   advice="wait for it, or give this one another output")

    def acquire(self) -> "RunLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise RunLocked(f"{self.path}: {self.holder} ({_who(holder)}); {self.advice}") from None
        except OSError as e:  # a file system without locks (some network mounts): run, but say so
            print(f"{self.path}: cannot lock ({e.strerror}); make sure no other trainer uses this run_dir", flush=True)
            os.close(fd)
            return self
        previous = _read(fd)
        if previous:
            print(f"{self.path}: taking over the lock of a trainer that is gone ({_who(previous)})", flush=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(),
              "since": datetime.datetime.now().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # a clean exit leaves no holder to report
            os.close(self.fd)  # closing drops the lock
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}


def _who(holder: dict) -> str:
    if not holder:
        return "holder unknown"
    return f"host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('since')}"
