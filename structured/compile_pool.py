"""CompilePool: the grammar compiler's books and workers (structured/compiler.py is its
face): the LRU of compiled grammars, admission against the pending cap, the two lanes'
queues, and one runner thread per worker process.

Invariants (all under ``_lock``):
- ``_entries`` maps a constraint's key to its job: DONE jobs are the cache (LRU by count and
  by their grammars' bytes); in-flight jobs (QUEUED / RUNNING) are the pending compiles,
  never evicted, at most ``max_pending`` of them, at most half of those in the SLOW lane;
- a job is queued in exactly one lane's deque while QUEUED, in none otherwise;
- a job leaves ``_entries`` when it is dropped (its last waiter left), when it failed for
  a reason that is not the constraint's fault (time limit, a worker that died), or when
  evicted from the cache; a refusal for capacity never creates one;
- a runner owns its WorkerProcess; a job's running time starts when its worker has it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import xgrammar

from ..errors import CapacityError
from ..kernel_backends import intra_op
from .compile_job import CompileJob, Lane, State
from .worker_process import Outcome, Result, WorkerProcess
from .zygote import Zygote

if TYPE_CHECKING:
    from .compile_settings import CompileSettings
    from .constraint import StructuredOutputs

log = logging.getLogger(__name__)


class CompilePool:
    def __init__(self, settings: CompileSettings, tokenizer_info: Callable[[], xgrammar.TokenizerInfo]):
        self.settings = settings
        self._make_info = tokenizer_info
        self._info: xgrammar.TokenizerInfo | None = None  # to deserialize grammars with
        self._info_lock = threading.Lock()  # the tokenizer info is built once, off _lock
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # a job was queued, or stop
        self._entries: OrderedDict[tuple, CompileJob] = OrderedDict()
        self._queues: dict[Lane, deque[CompileJob]] = {Lane.FAST: deque(), Lane.SLOW: deque()}
        self._cached_bytes = 0
        self.hits = self.misses = 0
        self._runners: list[threading.Thread] = []
        self._workers: list[WorkerProcess] = []
        self._stopped = False
        self._zygote: Zygote | None = None  # made by the first runner

    # ---- any thread ---------------------------------------------------------------------
    def acquire(self, constraint: StructuredOutputs) -> CompileJob:
        """The job of ``constraint`` (validated and within the limits): the cached one, the
        one in flight (as one more waiter), or a new one queued now; CapacityError if the
        pending compiles are at the cap. Pair with ``release``."""
        key = constraint.key()
        with self._lock:
            if self._stopped:
                raise RuntimeError("the grammar compiler has stopped")
            job = self._entries.get(key)
            if job is not None:
                self.hits += 1
                self._entries.move_to_end(key)
                if job.in_flight:
                    job.waiters += 1
                return job
            self.misses += 1
            size = source_bytes(key)
            lane = Lane.FAST if size <= self.settings.fast_bytes else Lane.SLOW
            self._admit(lane)
            job = CompileJob(constraint, key, lane, size)
            self._entries[key] = job
            self._queues[lane].append(job)
            self._start_runners()
            self._work.notify_all()
            return job

    def release(self, job: CompileJob) -> None:
        """One waiter of ``job`` left (done, cancelled, disconnected): the last one of a job
        still in flight drops it from its queue, or kills its worker."""
        with self._lock:
            if not job.in_flight:
                return
            job.waiters -= 1
            if job.waiters > 0:
                return
            if job.state is State.QUEUED:
                self._queues[job.lane].remove(job)
            job.state = State.DROPPED  # a running job's worker sees it within ~50 ms
            self._forget(job)
        job.future.cancel()

    def pending(self) -> int:
        with self._lock:
            return sum(j.in_flight for j in self._entries.values())

    def cache_size(self) -> int:
        with self._lock:
            return sum(not j.in_flight for j in self._entries.values())

    def zygote_pid(self) -> int | None:
        return None if self._zygote is None else self._zygote.pid

    def worker_pids(self) -> list[int]:
        return [pid for pid in (w.pid for w in self._workers) if pid is not None]

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            queued = [j for q in self._queues.values() for j in q]
            for q in self._queues.values():
                q.clear()
            stopped = queued + [j for j in self._entries.values() if j.state is State.RUNNING]
            for job in stopped:  # their workers see it and are killed
                job.state = State.DROPPED
                self._forget(job)
            self._work.notify_all()
        with self._info_lock:
            if self._zygote is not None:
                self._zygote.stop()
        for job in stopped:
            if not job.future.done():
                job.future.set_exception(RuntimeError("the grammar compiler has stopped"))

    # ---- under the lock -----------------------------------------------------------------
    def _admit(self, lane: Lane) -> None:
        cap = self.settings.max_pending
        flying = [j for j in self._entries.values() if j.in_flight]
        if len(flying) >= cap:
            raise CapacityError(
                f"structured_outputs: the grammar compiler is busy: {len(flying)} compiles "
                f"pending, the most --max-pending-grammars allows ({cap}); retry later")
        slow = sum(j.lane is Lane.SLOW for j in flying)
        if lane is Lane.SLOW and slow >= max(1, cap // 2):
            raise CapacityError(
                f"structured_outputs: the grammar compiler is busy: {slow} large grammars "
                f"(over {self.settings.fast_bytes} bytes) pending, the most allowed (half of "
                f"--max-pending-grammars {cap}); retry later")

    def _forget(self, job: CompileJob) -> None:
        if self._entries.get(job.key) is job:
            del self._entries[job.key]
            if job.state is State.DONE:
                self._cached_bytes -= job.grammar_bytes

    def _evict(self) -> None:
        """Least recently used DONE entries out, past the count or the bytes budget."""
        s = self.settings
        done = [j for j in self._entries.values() if not j.in_flight]  # oldest first
        count = len(done)
        for job in done:
            if count <= s.capacity and self._cached_bytes <= s.cache_bytes:
                return
            self._forget(job)
            count -= 1

    def _start_runners(self) -> None:
        if self._runners:
            return
        lanes = [(Lane.FAST,)] + [(Lane.SLOW, Lane.FAST)] * self.settings.workers
        for i, lane_order in enumerate(lanes):
            runner = threading.Thread(target=self._run, args=(i, lane_order), daemon=True,
                                      name=f"loraplex-grammar-{i}")
            self._runners.append(runner)
            runner.start()

    # ---- runner threads -----------------------------------------------------------------
    def _run(self, index: int, lanes: tuple[Lane, ...]) -> None:
        intra_op.serial_thread()
        try:
            zygote = self._the_zygote()
        except Exception as e:
            log.exception("the grammar compiler cannot read the tokenizer")
            while (job := self._take(lanes)) is not None:
                self._settle(job, None, RuntimeError(f"the grammar compiler cannot start: "
                                                     f"{e!r}"), cache=False)
            return
        worker = WorkerProcess(zygote)
        self._workers.append(worker)
        try:
            while not self._stopped:
                try:
                    worker.ensure_started()  # a killed worker is replaced before the next job
                except RuntimeError:
                    log.exception("grammar compile worker %d did not start", index)
                job = self._take(lanes)
                if job is None:
                    return
                self._finish(job, self._attempt(worker, job, lanes))
        finally:
            worker.kill()

    def _take(self, lanes: tuple[Lane, ...]) -> CompileJob | None:
        with self._lock:
            while not self._stopped:
                for lane in lanes:
                    if self._queues[lane]:
                        job = self._queues[lane].popleft()
                        job.state = State.RUNNING
                        return job
                self._work.wait()
            return None

    def _attempt(self, worker: WorkerProcess, job: CompileJob, lanes: tuple[Lane, ...]
                 ) -> Result:
        s = self.settings
        fast_try = lanes == (Lane.FAST,) and s.fast_seconds < s.timeout_s
        limit = s.fast_seconds if fast_try else s.timeout_s
        try:
            result = worker.run(job.constraint, s.max_compiled_bytes, limit, job.wanted)
        except RuntimeError as e:  # the worker could not start
            return Result(Outcome.NO_WORKER, str(e))
        worker.recycle_if_grown(result)
        if fast_try and result.outcome is Outcome.TIMEOUT:
            with self._lock:  # past the fast budget: the full limit on a general worker
                if job.state is State.RUNNING:
                    job.lane, job.state = Lane.SLOW, State.QUEUED
                    self._queues[Lane.SLOW].append(job)
                    self._work.notify_all()
            return Result(Outcome.ABANDONED)
        return result

    def _finish(self, job: CompileJob, result: Result) -> None:
        c = job.constraint
        grammar, error, cache, cost = None, None, True, 0
        if result.outcome is Outcome.ABANDONED:
            return
        if result.outcome is Outcome.OK:
            try:
                grammar = xgrammar.CompiledGrammar.deserialize_json(result.detail, self._info)
                # what it holds here: memory_size_bytes says ~1/3 of it for a deserialized
                # grammar; the serialized size comes closer (measured RSS per cached grammar)
                cost = max(grammar.memory_size_bytes, len(result.detail))
            except (RuntimeError, ValueError) as e:
                error, cache = RuntimeError(f"a compiled grammar did not deserialize: {e}"), False
        elif result.outcome is Outcome.TIMEOUT:
            error, cache = ValueError(
                f"structured_outputs: compiling the {c.describe()} took longer than the time "
                f"limit of {self.settings.timeout_s:g} s (--grammar-compile-timeout); its "
                "compile was stopped"), False
        elif result.outcome is Outcome.NO_WORKER:  # the server's fault: a 500
            error, cache = RuntimeError(result.detail), False
        elif result.outcome is Outcome.DIED:
            error, cache = ValueError(
                f"structured_outputs: the {c.describe()}'s compile stopped: its worker process "
                f"ended ({result.detail or 'killed, or out of memory'})"), False
        else:  # ERROR, TOO_LARGE: the constraint's own fault, the same every time
            error = ValueError(result.detail)
        self._settle(job, grammar, error, cache, cost)

    def _settle(self, job: CompileJob, grammar: xgrammar.CompiledGrammar | None,
                error: BaseException | None, cache: bool, cost: int = 0) -> None:
        with self._lock:
            if job.state is not State.RUNNING:
                return  # dropped meanwhile: nobody waits
            job.state = State.DONE
            if not cache:
                self._forget(job)
            elif grammar is not None and self._entries.get(job.key) is job:
                job.grammar_bytes = cost
                self._cached_bytes += job.grammar_bytes
            self._evict()
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(grammar)

    def _the_zygote(self) -> Zygote:
        """The one zygote of this pool, made on first use from the tokenizer (~0.2 s)."""
        with self._info_lock:
            if self._zygote is None:
                self._info = self._make_info()
                self._zygote = Zygote(self._info.serialize_json(), self.settings.memory_bytes)
                if self._stopped:
                    self._zygote.stop()
            return self._zygote


def source_bytes(key: tuple) -> int:
    """A constraint's source size from its cache key (``StructuredOutputs.key``)."""
    kind, value = key[0], key[1]
    if kind == "choice":
        return sum(len(s.encode()) + 1 for s in value)
    return len(value.encode()) if isinstance(value, str) else 0

