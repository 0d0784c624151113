"""Response bodies and stream chunks of /v1/completions and /v1/chat/completions, shaped
as vLLM sends them (OpenAI's objects plus vLLM's ``stop_reason``)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from ...engine.output_processor import RequestOutput

# the engine's finish reasons -> OpenAI's ("eos" is a "stop" there); vLLM adds "abort"
FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


def finish_reason(out: RequestOutput) -> str | None:
    return FINISH_REASON.get(out.finish_reason or "", out.finish_reason) if out.finished \
        else None


def usage(out: RequestOutput) -> dict[str, int]:
    """Counted tokens: the prompt as the engine saw it, every generated token."""
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event as vLLM writes it: ``data: <compact JSON>`` and a blank line."""
    data = payload if isinstance(payload, str) else \
        json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


DONE = sse("[DONE]")


@dataclass
class Reply:
    """What every body and chunk of one response repeats."""

    id: str
    model: str
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # ---- whole responses ----------------------------------------------------------------
    def body(self, out: RequestOutput) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        choice.update(logprobs=None, finish_reason=finish_reason(out), stop_reason=None)
        return {**self._head(self.object), "choices": [choice], "usage": usage(out)}

    # ---- stream chunks ------------------------------------------------------------------
    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def role_chunk(self) -> dict[str, Any]:
        """Chat streams open with the assistant role and empty content."""
        delta = {"role": "assistant", "content": ""}
        return {**self._head(self._chunk_object),
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": None}]}

    def chunk(self, out: RequestOutput) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": out.new_text}
        else:
            choice["text"] = out.new_text
        choice.update(logprobs=None, finish_reason=finish_reason(out))
        if out.finished:
            choice["stop_reason"] = None
        return {**self._head(self._chunk_object), "choices": [choice]}

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        """``stream_options.include_usage``: the last chunk, with no choices."""
        return {**self._head(self._chunk_object), "choices": [], "usage": usage(out)}
