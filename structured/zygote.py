"""Zygote: the server's handle on the process that forks grammar-compile workers.

The zygote is a fresh interpreter (``python -m loraplex.structured.compile_worker``),
started once: it imports xgrammar (and torch, which xgrammar imports) and builds the
xgrammar compiler for the model's tokenizer, then forks one worker per request. A worker
so starts in milliseconds with those pages shared, which makes killing one (a compile past
its time limit, or no longer wanted) cheap. Why not the alternatives: a fork of the server
would inherit its threads and OpenMP pool half-held; multiprocessing's spawn and
forkserver import the caller's ``__main__`` again in each child (a user's unguarded script
would run once per worker); a fresh interpreter per worker costs ~1.5 s of CPU and ~180 MB
each.

Protocol on a Unix socket pair (multiprocessing Connection messages): the server sends
``(tokenizer_info_json, memory_limit)`` and gets ``"ready"``; then per ``"spawn"`` it gets
the worker's pid and, as SCM_RIGHTS, the worker's end of a new socket pair. The zygote
ignores SIGCHLD (the kernel reaps its workers); the server signals a worker through a
pidfd where the platform has one, so a reused pid is never hit.

Thread-safe: one lock around the socket.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from .compile_worker import CONTROL_FD_ENV

START_TIMEOUT_S = 120.0  # an interpreter importing xgrammar (torch): ~1.5 s, more when loaded
_MODULE = "loraplex.structured.compile_worker"
# the directory holding the loraplex package, so the zygote imports this very copy
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


@dataclass
class Forked:
    """One worker the zygote forked: its pid, the server's end of its socket, and a pidfd
    (None where the platform has none)."""

    pid: int
    conn: Connection
    pidfd: int | None

    def kill(self) -> None:
        """SIGKILL, through the pidfd when there is one (race-free against pid reuse)."""
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        self.conn.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class Zygote:
    def __init__(self, tokenizer_info: str, memory_limit: int | None):
        self._setup = (tokenizer_info, memory_limit)
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._stopped = False

    def fork(self) -> Forked:
        """A new worker, ready for a job; RuntimeError if none can be made."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("the grammar compiler has stopped")
            for attempt in range(2):  # a zygote that died is started again once
                if self._process is None or self._process.poll() is not None:
                    self._start()
                try:
                    return self._fork()
                except (EOFError, OSError):
                    self._end()
                    if attempt:
                        raise RuntimeError("the grammar compiler's zygote process stopped "
                                           "answering") from None
            raise AssertionError("unreachable")

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._end()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    # ---- under the lock -----------------------------------------------------------------
    def _start(self) -> None:
        self._end()
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
        env[CONTROL_FD_ENV] = str(theirs.fileno())
        with theirs:
            process = subprocess.Popen([sys.executable, "-m", _MODULE],
                                       pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                       env=env)
        self._process, self._conn = process, Connection(ours.detach())
        try:
            self._conn.send(self._setup)
            if not self._conn.poll(START_TIMEOUT_S) or self._conn.recv() != "ready":
                raise EOFError
        except (EOFError, OSError):
            self._end()
            raise RuntimeError("the grammar compiler's zygote process did not start") from None

    def _fork(self) -> Forked:
        assert self._conn is not None
        self._conn.send("spawn")
        pid = self._conn.recv()
        with socket.fromfd(self._conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
            _, fds, _, _ = socket.recv_fds(s, 1, 1)
        if not fds:
            raise EOFError
        pidfd = None
        if hasattr(os, "pidfd_open"):
            try:  # the worker waits for its first job: it is alive, and the pid is its own
                pidfd = os.pidfd_open(pid)
            except OSError:
                pidfd = None
        return Forked(pid, Connection(fds[0]), pidfd)

    def _end(self) -> None:
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if conn is not None:
            conn.close()  # its workers keep their own sockets; the zygote exits on EOF
        if process is not None:
            if process.poll() is None:
                process.kill()
            process.wait()
