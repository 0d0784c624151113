"""Server-sent events and client disconnects: a streamed response whose cleanup always
runs, and a non-streamed request that is cancelled when its client goes away. Either way
the engine aborts the sequence and its KV blocks are freed (server/generation.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that awaits ``on_close`` however it ends: finished, failed,
    or cancelled by a client disconnect (even before the first chunk was sent)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 media_type: str = "text/event-stream", headers: dict[str, str] | None = None):
        super().__init__(content, media_type=media_type, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is cancelled (which
    aborts its request in the engine) and ClientGone is raised."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself was cancelled (shutdown)
        await _cancel(task, watch)
        raise
    if task in done:
        watch.cancel()
        return task.result()
    await _cancel(task, watch)
    raise ClientGone()


async def _cancel(*tasks: asyncio.Future) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
