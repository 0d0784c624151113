"""One generate request through the engine, front-neutral: the gRPC Inference servicer and
the HTTP completions routes both call these, so admission (``--max-queue``), the adapter
rule, error mapping and metrics are the same on every front.

Invariant: closing an ``outputs`` stream early (client cancel, disconnect, deadline) aborts
the request (every choice) in the engine at once, which frees its KV blocks, and counts it
as an abort. A request of n choices streams the outputs of choices 0..n-1 interleaved
(``RequestOutput.index``), each choice ending with its own finished output.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, aclosing
from dataclasses import replace
from typing import TypeVar

from ..engine.async_engine import AsyncEngine
from ..engine.input_processor import EngineRequest, RequestInput
from ..engine.output_processor import RequestOutput
from ..errors import AdapterFaultError, AdapterNotFoundError
from .error_code import ErrorCode, ServiceError
from .state import ServerState

T = TypeVar("T")

# a front's translation of its request: the engine's RequestInput, and what the front
# keeps for its reply (HTTP's View; None for gRPC)
Translate = Callable[[], tuple[RequestInput, T]]


async def check(state: ServerState, translate: Translate[T]) -> tuple[EngineRequest, T]:
    """A front's request checked, in one hop to the engine's InputProcessor thread: there
    the front translates its fields (``translate``: prompt rules, chat template), its
    ``model`` becomes the adapter (``ServerState.adapter_of``), and the InputProcessor makes
    every check once. Raises what they raise (bad field: INVALID_ARGUMENT, unknown adapter:
    NOT_FOUND); compiles nothing (``outputs`` asks for the grammar, last)."""
    engine = state.require_engine()
    kept: list[T] = []

    def translated() -> RequestInput:
        inp, keep = translate()
        kept.append(keep)
        return replace(inp, adapter=state.adapter_of(inp.adapter or ""),
                       may_resolve=state.resolver is not None)

    request = await engine.process(translated)
    return request, kept[0]


async def resolve(state: ServerState, model: str | None) -> None:
    """With a resolver: ``model``'s adapter loaded before its request is tokenized, so that
    an adapter bringing its own tokenizer (lora/adapter_vocab.py) tokenizes the very request
    that loads it (vLLM's resolver loads before it tokenizes too). A front calls this before
    ``ServerState.tokenizer_of``. NOT_FOUND when the resolver has no such adapter; a name
    ``adapter_of`` refuses, the base model's or a registered one load nothing (the check
    refuses the first with its own error)."""
    if state.resolver is None:
        return
    try:
        name = state.adapter_of(model or "")
    except ValueError:
        return
    if name is not None and not state.resolver.registered(name):
        with state.hold_place() as engine:  # a load is work: bounded by --max-queue
            await _ensure(state, engine, name)


async def _ensure(state: ServerState, engine: AsyncEngine, name: str) -> None:
    """The resolver's load of ``name``; NOT_FOUND with its reason and what is valid."""
    try:
        await state.resolver.ensure(name)
    except AdapterNotFoundError as e:
        raise AdapterNotFoundError(f"{e}; {engine.engine.base_model_hint()}") from None


async def outputs(state: ServerState, engine: AsyncEngine, request: EngineRequest
                  ) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for a checked ``request``, recorded in ``state.metrics``, until
    every choice has finished: its adapter loaded by the resolver if it was unknown, its
    grammar compiled last. An engine-side failure of the request raises INTERNAL, a fault
    of its adapter's data FAILED_PRECONDITION."""
    if request.adapter_id is None:  # --lora-resolver-dir: loaded on first use
        await _ensure(state, engine, request.adapter_name or "")
        request = engine.processor.bind(request)
    track = state.metrics.track(request.adapter_name, request.params.n)
    choices_left = request.params.n
    try:
        # its grammar last, once every other check passed: the compile runs in a worker
        # process while this waits (the engine steps on; the processor's thread is free)
        request = await engine.processor.compile_async(request)
        async with aclosing(engine.stream(request)) as outs:
            async for out in outs:
                if out.finish_reason == "error":
                    raise _engine_failure(out)
                track.observe(out)
                choices_left -= out.finished
                yield out
    except (asyncio.CancelledError, GeneratorExit):
        if choices_left > 0:  # the caller left: the engine aborts it
            track.finish("abort")
        raise


def _engine_failure(out: RequestOutput) -> Exception:
    """AdapterFaultError (FAILED_PRECONDITION) when the adapter's data is at fault (NaN / Inf
    logits on it, its files refused on a re-read): the adapter must be replaced, the server
    is fine; else INTERNAL (an engine fault: a bug)."""
    if out.adapter_fault:
        return AdapterFaultError(f"request {out.request_id} failed: {out.error or 'no detail'}")
    return ServiceError(ErrorCode.INTERNAL, f"request {out.request_id} failed in the engine: "
                                            f"{out.error or 'no detail'}")


async def complete(state: ServerState, request: EngineRequest) -> list[RequestOutput]:
    """Run ``request`` to the end inside one of the ``--max-queue`` places; each choice's
    last output, by index."""
    n = request.params.n
    with state.admit() as engine:
        finals: dict[int, RequestOutput] = {}
        async with aclosing(outputs(state, engine, request)) as outs:
            async for out in outs:
                if out.finished:
                    finals[out.index] = out
    # the engine always ends every choice with a finished output
    assert sorted(finals) == list(range(n)), sorted(finals)
    return [finals[i] for i in range(n)]


class OpenStream:
    """A streamed request already admitted and accepted by the engine (its first output
    is in hand, so a bad request fails before anything is streamed). Iterate it once;
    ``aclose`` (always call it) aborts what is unfinished and frees the admission place."""

    def __init__(self, first: RequestOutput, rest: AsyncIterator[RequestOutput],
                 stack: AsyncExitStack, choices: int):
        self.first = first
        self.choices = choices
        self._rest = rest
        self._stack = stack

    @classmethod
    async def open(cls, state: ServerState, request: EngineRequest) -> OpenStream:
        stack = AsyncExitStack()
        try:
            engine = stack.enter_context(state.admit())
            outs = await stack.enter_async_context(aclosing(outputs(state, engine, request)))
            first = await anext(outs)
        except BaseException:
            await stack.aclose()
            raise
        return cls(first, outs, stack, request.params.n)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        yield self.first
        if not (self.first.finished and self.choices == 1):
            async for out in self._rest:
                yield out

    async def aclose(self) -> None:
        await self._stack.aclose()
