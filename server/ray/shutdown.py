"""SIGTERM / SIGINT for ``loraplex serve --ray``: a stop request that the main thread waits
on, that can interrupt Ray's start-up, and that bounds how long the process may live after it.

Why a hard bound: a supervisor that signals the whole process group (systemd, ``timeout``,
a container runtime) stops Ray's controller and raylet together with this process; Ray calls
then wait on the dead processes forever, in the main thread or anywhere else."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType

log = logging.getLogger(__name__)


class Shutdown:
    """The first signal sets the stop request and arms ``faulthandler``'s watchdog: a C
    thread that needs neither the GIL nor the main thread, dumps every thread's stack and
    ``_exit(1)``s after ``hard_deadline_s``. Inside ``interruptible()`` the signal also
    raises KeyboardInterrupt in the main thread, which Ray's blocking calls honour."""

    def __init__(self, hard_deadline_s: float) -> None:
        self.hard_deadline_s = hard_deadline_s
        self._requested = threading.Event()
        self._interruptible = False

    @property
    def requested(self) -> bool:
        return self._requested.is_set()

    def install(self) -> None:
        """Take SIGTERM and SIGINT (call after ``ray.init``, which replaces the handlers)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def wait(self) -> None:
        """Block until a signal came (waking each second, so that signals are handled)."""
        while not self._requested.wait(1.0):
            pass

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """While inside, a signal raises KeyboardInterrupt here, as well as requesting the
        stop (also when it came just before the block was entered)."""
        self._interruptible = True
        try:
            if self.requested:
                raise KeyboardInterrupt
            yield
        finally:
            self._interruptible = False

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            log.info("%s again: already shutting down", name)
            return
        log.info("%s: shutting down (hard exit in %.0fs)", name, self.hard_deadline_s)
        self._requested.set()
        faulthandler.dump_traceback_later(self.hard_deadline_s, exit=True)
        if self._interruptible:
            raise KeyboardInterrupt
