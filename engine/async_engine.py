"""AsyncEngine: the engine loop on its own thread; asyncio callers get a stream per request.

Only the engine thread touches the LLMEngine, but for its thread-safe doors (the
InputProcessor, run on its own thread, and ``prefetch_adapter``). Callers hand it work
through a command queue (new requests, aborts, admin calls) and receive RequestOutputs
through asyncio queues fed with ``call_soon_threadsafe``. A request is checked and tokenized
by the InputProcessor on its thread (``process``: one hop there and back, with the front's
translation of its fields): neither the caller's event loop nor the engine thread waits on
it. A constrained request's grammar is compiled after that (in the compiler's worker
processes), and only a request that passed every check costs a compile.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from ..errors import EngineDeadError, InvalidRequestError
from .input_processor import EngineRequest, InputProcessor, RequestInput
from .llm_engine import LLMEngine, Prompt
from .output_processor import RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # of RequestOutput | BaseException

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine | None):
        self.engine = engine  # None only until ``build`` has built it
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._go = threading.Event()  # start() was called
        self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)
        self.error: BaseException | None = None  # set when the loop died
        self.on_death: Callable[[BaseException], None] | None = None

    # ---- lifecycle ----------------------------------------------------------------------
    @classmethod
    async def build(cls, factory: Callable[[], LLMEngine]) -> AsyncEngine:
        """Build the engine on the engine thread, whose loop then runs there from ``start``:
        the thread that steps is the only one holding an OpenMP pool (kernel_backends/intra_op.py).
        Raises what ``factory`` raises."""
        engine = cls(None)
        built: Future = Future()
        engine._thread = threading.Thread(target=engine._build_then_loop, args=(factory, built),
                                          name="loraplex-engine", daemon=True)
        engine._thread.start()
        await asyncio.wrap_future(built)
        return engine

    def start(self) -> None:
        if not self._thread.is_alive():  # else ``build`` started it, waiting for _go
            self._thread.start()
        self._go.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._go.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.engine is not None:
            self.engine.input_processor.shutdown()  # its thread
            self.engine.constraints.shutdown()  # its worker processes

    @property
    def processor(self) -> InputProcessor:
        """The engine's InputProcessor: every request check, on its own thread."""
        return self.engine.input_processor

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- caller side --------------------------------------------------------------------
    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run ``fn(engine)`` on the engine thread between steps; a Future of its result."""
        self._check_alive()
        fut: Future = Future()

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

        self._commands.put(run)
        self._wake.set()
        return fut

    async def run(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       adapter: str | None = None, request_id: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's RequestOutputs as tokens arrive (the Python API: ``process``,
        its grammar compiled, then ``stream``; each output holds what is new, the finished
        one the whole answer: output_processor.py). With ``params.n`` > 1 the outputs of
        choices 0..n-1 interleave (``RequestOutput.index``), each choice ending with its own
        finished output; the stream ends once every choice has finished. Leaving early
        (cancel, deadline, aclose) aborts every choice and frees its blocks."""
        request = await self.process(RequestInput(prompt, params, adapter, request_id))
        request = await self.processor.compile_async(request)
        async with aclosing(self.stream(request)) as outputs:
            async for out in outputs:
                yield out

    async def process(self, translate: RequestInput | Callable[[], RequestInput]
                      ) -> EngineRequest:
        """The checked request (InputProcessor.process) on the processor's thread, in one
        hop: ``translate``, a front's translation of its fields, runs there first. Raises
        what they raise (InvalidRequestError naming the field, AdapterNotFoundError). Its
        adapter's read from disk starts at once; its grammar is not compiled yet (the
        caller asks for it last: ``processor.compile_async``)."""
        processor = self.processor

        def checked() -> EngineRequest:
            inp = translate() if callable(translate) else translate
            if inp.request_id is None:  # unguessable: ids a client chose must not collide
                inp = replace(inp, request_id=f"req-{uuid.uuid4().hex}")
            return processor.process(inp)

        request = await processor.run(checked)
        self.engine.prefetch_adapter(request)  # the read overlaps the step in progress
        return request

    async def stream(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Add a checked request (its grammar compiled) on the engine thread and yield its
        RequestOutputs (see ``generate``)."""
        rid = request.request_id
        if rid in self._streams:
            raise InvalidRequestError(f"request_id {rid!r} is already in use")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[rid] = stream  # the id is taken from here on
        finished = False
        choices_left = request.params.n
        try:
            seq = self.engine.sequence_of(request)  # its matcher made here, off the engine
            await self.run(lambda e: e.add_sequence(seq))
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                choices_left -= item.finished
                finished = choices_left == 0
                yield item
        finally:
            self._streams.pop(rid, None)
            if not finished and self.alive:
                self.call(lambda e: e.abort(rid))

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self.error!r}")
        if self._stop.is_set():
            raise EngineDeadError("the engine is shutting down")

    # ---- engine thread ------------------------------------------------------------------
    def _build_then_loop(self, factory: Callable[[], LLMEngine], built: Future) -> None:
        try:
            self.engine = factory()
        except BaseException as e:  # noqa: BLE001 - handed to build's caller
            built.set_exception(e)
            return
        built.set_result(None)
        self._go.wait()
        self._loop()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._run_commands()
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as e:
            log.exception("engine loop died")
            self.error = e
            for stream in list(self._streams.values()):
                stream.put(EngineDeadError(f"the engine loop has stopped: {e!r}"))
            if self.on_death is not None:
                self.on_death(e)

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """One hand-off per event loop per step, not one per output: the loop's thread wakes
        once a step, and the GIL changes hands once, however many requests run."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue_, out in items:
        queue_.put_nowait(out)

