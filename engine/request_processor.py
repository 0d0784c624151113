"""RequestProcessor: a request's host work before the engine thread sees it, on a thread of
its own. The prompt goes through the tokenizer (and, for the fronts, the chat template),
the sampling params are filled with the model's defaults and checked, and the result is
the Sequence the engine thread adds. vLLM's ``Processor`` is the model.

Why a thread: tokenizing a long prompt or rendering a chat template takes milliseconds to
seconds of CPU. On the asyncio loop it stalls both fronts (health probes and every other
request's stream wait); on the engine thread it stalls every running sequence's step.

Invariants:
- one worker thread, so requests are prepared in arrival order and the tokenizer is used by
  one preparing thread at a time (vLLM's tokenizer executor has one worker too);
- the worker starts with ``intra_op.serial_thread``: it may run a torch op through the
  engine's checks, and must never start an OpenMP pool (kernel_backends/intra_op.py);
- nothing here touches the engine's mutable state: ``LLMEngine.make_sequence`` reads only
  the model, the config and one dict lookup of the adapter name; the engine thread adds
  the Sequence (``add_sequence``), which checks again that the adapter is still there.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from ..kernel_backends import intra_op
from .sampling_params import SamplingParams
from .sequence import Sequence

if TYPE_CHECKING:
    from .llm_engine import LLMEngine, Prompt

T = TypeVar("T")

THREAD_NAME = "loraplex-request"


class RequestProcessor:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME,
                                        initializer=intra_op.serial_thread)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the processor's thread, awaited from the loop: a
        front's request conversion (chat template, prompt rules) goes through here."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def sequence(self, engine: LLMEngine, prompt: Prompt, params: SamplingParams | None,
                       adapter: str | None, request_id: str) -> Sequence:
        """The checked Sequence for one request (raises what ``make_sequence`` raises:
        InvalidRequestError naming the field, AdapterNotFoundError), without its grammar:
        the caller compiles that next (a compile never holds this thread)."""
        return await self.run(engine.make_sequence, prompt, params, adapter, request_id,
                              compile_grammar=False)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
