"""GrammarCompiler: StructuredOutputs → xgrammar CompiledGrammar, compiled in worker
processes, into an LRU cache keyed by the constraint (``StructuredOutputs.key``).

A request waits for its own grammar (``compile`` blocks its caller, ``compile_async`` awaits
on its event loop); the engine step never compiles. The bounds (CompileSettings):

- **time**: a compile may run ``timeout_s`` seconds on its worker; its wait in the queue
  does not count. Past it the worker process is killed (xgrammar cannot be interrupted;
  its memory goes with it) and the request gets a ValueError saying so;
- **pending**: at most ``max_pending`` compiles queued or running; past it a new constraint
  gets CapacityError (the server's 429), and large ones (source over ``fast_bytes``) may
  hold only half of those places;
- **lanes**: one worker is kept for small constraints, which it runs first for up to
  ``fast_seconds`` (a longer one moves to the general workers), so a flood of slow
  schemas cannot hold back a cheap one; ``workers`` general workers run the rest;
- **size**: a compiled grammar past ``max_compiled_bytes`` (serialized), or a compile that
  needs more than ``memory_bytes``, is refused (ValueError);
- **abandon**: a compile whose waiters all left (cancelled, disconnected) leaves the queue,
  or its worker is killed;
- **cache**: a grammar, or an error that is the constraint's own (does not compile, too
  large), is kept; a time limit, a dead worker or a refusal for capacity is not.

The worker processes start on the first compile. Safe on any thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import xgrammar

from .compile_job import CompileJob
from .compile_pool import CompilePool
from .compile_settings import CompileSettings
from .constraint import StructuredOutputs


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    size: int
    capacity: int
    pending: int = 0


class GrammarCompiler:
    def __init__(self, tokenizer: object, vocab_size: int, stop_token_ids: Iterable[int],
                 settings: CompileSettings | None = None, **overrides: object):
        """``tokenizer``: the model's HF tokenizer; ``vocab_size``: the logits' width (the
        model's, which may exceed the tokenizer's); ``stop_token_ids``: the tokens that end
        an answer where the grammar accepts (the engine's EOS ids); ``overrides``: fields
        of CompileSettings."""
        settings = settings or CompileSettings()
        if overrides:
            settings = CompileSettings(**{**settings.__dict__, **overrides})
        self.settings = settings
        stop = sorted(stop_token_ids)

        def tokenizer_info() -> xgrammar.TokenizerInfo:  # built by the first runner (~0.2 s)
            return xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=stop or None)

        self._pool = CompilePool(settings, tokenizer_info)
        # the runners hold the pool, not this object: dropping the compiler stops them
        weakref.finalize(self, self._pool.shutdown)

    @property
    def capacity(self) -> int:
        return self.settings.capacity

    def compile(self, constraint: StructuredOutputs) -> xgrammar.CompiledGrammar:
        """Block until ``constraint`` is compiled: ValueError naming what is wrong (or the
        time limit), CapacityError if too many compiles are pending."""
        constraint.validate()
        job = self._pool.acquire(constraint)
        try:
            return job.future.result()
        finally:
            self._pool.release(job)

    async def compile_async(self, constraint: StructuredOutputs) -> xgrammar.CompiledGrammar:
        """``compile`` for an event loop: the loop runs on while the grammar compiles; a
        cancelled await gives up this request's claim on the compile."""
        constraint.validate()
        job = self._pool.acquire(constraint)
        try:
            return await _result(job)
        finally:
            self._pool.release(job)

    def stats(self) -> CacheStats:
        p = self._pool
        return CacheStats(p.hits, p.misses, p.cache_size(), self.capacity, p.pending())

    def worker_pids(self) -> list[int]:
        """The worker processes alive now (tests count them)."""
        return self._pool.worker_pids()

    @property
    def zygote_pid(self) -> int | None:
        """The process that forks the workers (None before the first compile)."""
        return self._pool.zygote_pid()

    def shutdown(self) -> None:
        self._pool.shutdown()


async def _result(job: CompileJob) -> xgrammar.CompiledGrammar:
    """The job's grammar, awaited without cancelling the shared future when this waiter is
    cancelled (other requests may wait for the same compile)."""
    fut: concurrent.futures.Future = job.future
    inner = asyncio.wrap_future(fut)
    # read by no one once this waiter is cancelled: mark its outcome seen
    inner.add_done_callback(lambda f: f.cancelled() or f.exception())
    return await asyncio.shield(inner)
