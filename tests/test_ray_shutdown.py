"""``serve --ray``'s signal handling (server/ray/shutdown.py), in child processes so that
pytest's own handlers and faulthandler are untouched: a signal during start-up interrupts
it, and the hard deadline ends a process whose main thread never comes back."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

PRELUDE = textwrap.dedent("""
    import os, signal, sys, time
    from loraplex.server.ray.shutdown import Shutdown
    shutdown = Shutdown(hard_deadline_s={deadline})
    shutdown.install()
    print("ready", flush=True)
""")


def run_child(body: str, deadline: float, timeout: float = 30) -> tuple[int, str, float]:
    """Start the child, SIGTERM it once it is ready; its exit code, output and the seconds
    from the signal to its exit."""
    proc = subprocess.Popen([sys.executable, "-c", PRELUDE.format(deadline=deadline) + body],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out, time.monotonic() - start


def test_a_signal_while_starting_interrupts_the_start() -> None:
    code, out, _ = run_child(textwrap.dedent("""
        try:
            with shutdown.interruptible():
                time.sleep(60)  # a start-up that would take long
        except KeyboardInterrupt:
            print("interrupted", shutdown.requested)
    """), deadline=30)
    assert code == 0 and "interrupted True" in out, out


def test_a_signal_while_serving_requests_the_stop_and_a_second_one_is_ignored() -> None:
    code, out, took = run_child(textwrap.dedent("""
        shutdown.wait()
        print("stop requested", shutdown.requested, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # a supervisor repeating itself mid-teardown
        time.sleep(0.5)
        print("teardown done")
    """), deadline=30)
    assert code == 0 and "stop requested True" in out and "teardown done" in out, out
    assert took < 10, took  # no hang (not a timing target)


def test_the_hard_deadline_ends_a_main_thread_that_never_returns() -> None:
    # After the stop request the main thread blocks forever (as on a dead Ray controller):
    # faulthandler's watchdog dumps the stacks and exits 1 at the deadline.
    code, out, took = run_child("shutdown.wait()\nwhile True:\n    time.sleep(3600)\n",
                                deadline=1.5)
    assert code == 1, out
    assert "Timeout" in out, out  # faulthandler says why, with every thread's stack
    assert 1.0 < took < 10, took
