"""WorkerProcess: the server's handle on one grammar-compile worker (forked by the zygote,
structured/zygote.py; compile_worker.serve runs inside it): hand it one compile with a
time limit, kill it.

Invariants: one job at a time per worker; a worker that ran past its job's time limit, or
whose job was abandoned, is killed (its memory returns to the system) and a fresh one is
forked before its runner takes the next job; only its runner thread touches a
WorkerProcess.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait

from .constraint import StructuredOutputs
from .zygote import Forked, Zygote

_POLL_S = 0.05  # how often a running job checks whether it is still wanted
RECYCLE_GROWTH = 128 << 20  # a worker grown this much past its size when forked is replaced
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_EXIT_WAIT_S = 5.0  # a killed worker's socket closes once the kernel has ended it


class Outcome(enum.Enum):
    OK = "ok"  # detail: the compiled grammar's JSON text
    ERROR = "error"  # the constraint does not compile: detail names why
    TOO_LARGE = "too_large"  # its compiled form or memory passes the limits: detail says
    TIMEOUT = "timeout"  # ran past the time limit; the process was killed
    ABANDONED = "abandoned"  # nobody waits for it; the process was killed
    DIED = "died"  # the process ended without an answer (killed from outside, a crash)
    NO_WORKER = "no_worker"  # no process could start: detail says why


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    detail: str = ""
    seconds: float = 0.0  # the compile's running time


class WorkerProcess:
    def __init__(self, zygote: Zygote):
        self._zygote = zygote
        self._worker: Forked | None = None
        self._forked_rss: int | None = None

    @property
    def pid(self) -> int | None:
        return None if self._worker is None else self._worker.pid

    def ensure_started(self) -> None:
        """A live, idle worker (a fresh one if there is none, or it died); RuntimeError if
        none can be made."""
        if self._worker is not None and not self._worker.conn.poll():  # idle: no EOF
            return
        self.kill()
        self._worker = self._zygote.fork()
        self._forked_rss = _rss(self._worker.pid)

    def recycle_if_grown(self, result: Result) -> None:
        """Replace the worker after a compile that ran out of room (its heap may keep what
        it took), or once it has grown RECYCLE_GROWTH past its size when forked: its
        memory goes back to the system; a fork costs ~10 ms."""
        if self._worker is None:
            return
        rss = _rss(self._worker.pid)
        grown = rss is not None and self._forked_rss is not None and \
            rss - self._forked_rss > RECYCLE_GROWTH
        if result.outcome is Outcome.TOO_LARGE or grown:
            self.kill()

    def run(self, constraint: StructuredOutputs, max_bytes: int, time_limit: float,
            wanted: Callable[[], bool]) -> Result:
        """Compile ``constraint`` in the worker, at most ``time_limit`` seconds of running
        time; the worker is killed past it, or as soon as ``wanted()`` turns false."""
        self.ensure_started()
        assert self._worker is not None
        conn = self._worker.conn
        start = time.monotonic()
        try:
            conn.send((constraint, max_bytes))
        except (OSError, ValueError):
            self.kill()
            return Result(Outcome.DIED)
        while True:
            elapsed = time.monotonic() - start
            if not wanted():
                self.kill()
                return Result(Outcome.ABANDONED, seconds=elapsed)
            if elapsed >= time_limit:
                self.kill()
                return Result(Outcome.TIMEOUT, seconds=elapsed)
            if wait([conn], min(_POLL_S, time_limit - elapsed)):  # an answer, or EOF
                try:
                    kind, detail = conn.recv()
                except (EOFError, OSError):
                    self.kill()
                    return Result(Outcome.DIED, seconds=time.monotonic() - start)
                return Result(Outcome(kind), detail, time.monotonic() - start)

    def kill(self) -> None:
        """End the worker now (SIGKILL: a compile cannot be interrupted); returns once its
        socket has closed, i.e. the process is gone."""
        worker, self._worker = self._worker, None
        if worker is None:
            return
        worker.kill()
        deadline = time.monotonic() + _EXIT_WAIT_S
        try:
            while time.monotonic() < deadline:
                if worker.conn.poll(_POLL_S):
                    worker.conn.recv()  # an answer sent just before the kill; then EOF
        except (EOFError, OSError):
            pass
        worker.close()


def _rss(pid: int) -> int | None:
    """A process's resident bytes (Linux's /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None
