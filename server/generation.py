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
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, aclosing
from dataclasses import dataclass

from ..engine.async_engine import AsyncEngine
from ..engine.output_processor import RequestOutput
from ..engine.sampling_params import SamplingParams
from ..errors import AdapterFaultError, AdapterNotFoundError
from .error_code import ErrorCode, ServiceError
from .prompt import Prompt
from .state import ServerState


@dataclass
class GenerateInput:
    """A checked request: what to continue, how, on which model."""

    prompt: Prompt
    params: SamplingParams
    model: str = ""  # an adapter name, or "" / the served model name / the base's id
    request_id: str | None = None


async def outputs(state: ServerState, engine: AsyncEngine, inp: GenerateInput
                  ) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for ``inp``, recorded in ``state.metrics``, until every choice
    has finished. An engine-side failure of the request raises INTERNAL, a fault of its
    adapter's data FAILED_PRECONDITION."""
    adapter = state.adapter_of(inp.model)
    if adapter is not None and state.resolver is not None:
        try:  # --lora-resolver-dir: loaded on first use
            await state.resolver.ensure(adapter)
        except AdapterNotFoundError as e:  # the resolver's reason, and what is valid
            raise AdapterNotFoundError(f"{e}; {engine.engine.base_model_hint()}") from None
    track = state.metrics.track(adapter, inp.params.n)
    choices_left = inp.params.n
    try:
        stream = engine.generate(inp.prompt, inp.params, adapter, inp.request_id)
        async with aclosing(stream) as outs:
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


async def complete(state: ServerState, inp: GenerateInput) -> list[RequestOutput]:
    """Run ``inp`` to the end inside one of the ``--max-queue`` places; each choice's last
    output, by index."""
    with state.admit() as engine:
        finals: dict[int, RequestOutput] = {}
        async with aclosing(outputs(state, engine, inp)) as outs:
            async for out in outs:
                if out.finished:
                    finals[out.index] = out
    # the engine always ends every choice with a finished output
    assert sorted(finals) == list(range(inp.params.n)), sorted(finals)
    return [finals[i] for i in range(inp.params.n)]


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
    async def open(cls, state: ServerState, inp: GenerateInput) -> OpenStream:
        stack = AsyncExitStack()
        try:
            engine = stack.enter_context(state.admit())
            outs = await stack.enter_async_context(aclosing(outputs(state, engine, inp)))
            first = await anext(outs)
        except BaseException:
            await stack.aclose()
            raise
        return cls(first, outs, stack, inp.params.n)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        yield self.first
        if not (self.first.finished and self.choices == 1):
            async for out in self._rest:
                yield out

    async def aclose(self) -> None:
        await self._stack.aclose()
