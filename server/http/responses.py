"""Response bodies and stream chunks of /v1/completions and /v1/chat/completions, shaped
as vLLM sends them (OpenAI's objects plus vLLM's ``stop_reason`` and ``prompt_logprobs``):
one choice per sample (``choices[i].index``), logprobs in OpenAI's completions or chat
form (openai_logprobs.py), ``echo``'s prompt in front of a completion, and usage counting the
prompt once and the tokens of every choice."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from ...engine.output_processor import RequestOutput
from .openai_logprobs import TokenText, chat_logprobs, completion_logprobs, prompt_logprobs
from .tool_calls import ToolCallStream, whole_message
from .tools import ToolPlan

# the engine's finish reasons -> OpenAI's ("eos" is a "stop" there); vLLM adds "abort"
FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


def finish_reason(out: RequestOutput, called: bool = False) -> str | None:
    """OpenAI's finish reason; ``called``: the answer holds tool calls, so a stop at the
    grammar's end (or the model's EOS) is ``"tool_calls"``."""
    if not out.finished:
        return None
    reason = FINISH_REASON.get(out.finish_reason or "", out.finish_reason)
    return "tool_calls" if called and reason == "stop" else reason


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event as vLLM writes it: ``data: <compact JSON>`` and a blank line."""
    data = payload if isinstance(payload, str) else \
        json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


DONE = sse("[DONE]")


@dataclass(frozen=True)
class View:
    """What a request asked to see beyond the text (set by request_convert.py)."""

    chat: bool
    logprobs: int | None = None  # top-k per token (chat: top_logprobs with logprobs on); -1: all
    echo_text: str | None = None  # completions echo: the prompt's text, shown first
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field
    token_ids_as_text: bool = False  # vLLM's return_tokens_as_token_ids
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    tools: ToolPlan | None = None  # chat: how the answer's tool calls are read


@dataclass
class Reply:
    """What every body and chunk of one response repeats, and a stream's state per choice."""

    id: str
    model: str
    view: View
    tokenizer: Any | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _tokens: dict[int, int] = field(default_factory=dict)  # choice -> generated so far
    _offset: dict[int, int] = field(default_factory=dict)  # choice -> text_offset reached
    _calls: dict[int, ToolCallStream] = field(default_factory=dict)  # choice -> tool calls sent
    _prompt_tokens: int = 0

    @property
    def chat(self) -> bool:
        return self.view.chat

    @property
    def _text(self) -> TokenText:
        return TokenText(self.tokenizer, self.view.token_ids_as_text)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _count(self, out: RequestOutput) -> None:
        self._prompt_tokens = len(out.prompt_token_ids)
        # echo with max_tokens 0: the one token the engine drew for the prompt's logprobs
        # is not shown, so not counted either
        self._tokens[out.index] = 0 if self.view.echo_only else out.num_output_tokens

    def usage(self) -> dict[str, int]:
        prompt, completion = self._prompt_tokens, sum(self._tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    # ---- whole responses ----------------------------------------------------------------
    def body(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """``finals``: each choice's last output, by index."""
        choices = []
        for out in finals:
            self._count(out)
            choices.append(self._chat_choice(out) if self.chat else self._text_choice(out))
        body = {**self._head("chat.completion" if self.chat else "text_completion"),
                "choices": choices, "usage": self.usage()}
        if self.chat and self.view.prompt_logprobs:
            body["prompt_logprobs"] = prompt_logprobs(finals[0].prompt_logprobs, self._text)
        return body

    def _chat_choice(self, out: RequestOutput) -> dict[str, Any]:
        k = self.view.logprobs
        message: dict[str, Any] = {"role": "assistant", "content": out.text}
        if self.view.tools is not None:
            message["content"], message["tool_calls"] = whole_message(self.view.tools, out.text)
        return {"index": out.index, "message": message,
                "logprobs": None if k is None else
                chat_logprobs(out.logprobs or [], k, self._text),
                "finish_reason": finish_reason(out, bool(message.get("tool_calls"))),
                "stop_reason": None}

    def _text_choice(self, out: RequestOutput) -> dict[str, Any]:
        text, ids, lps = self._completion_part(out, out.text, out.token_ids, out.logprobs,
                                               echo=True)
        choice = {"index": out.index, "text": text, "logprobs": self._completion_logprobs(
            ids, lps, 0), "finish_reason": finish_reason(out), "stop_reason": None}
        if self.view.prompt_logprobs:
            choice["prompt_logprobs"] = prompt_logprobs(out.prompt_logprobs, self._text)
        return choice

    def _completion_part(self, out: RequestOutput, text: str, ids: list[int],
                         lps: list | None, echo: bool) -> tuple[str, list[int], list]:
        """A completion's text, token ids and logprobs, behind the prompt's with ``echo``."""
        lps = list(lps) if lps is not None else [None] * len(ids)
        v = self.view
        if v.echo_only:
            text, ids, lps = "", [], []
        if v.echo_text is not None and echo:
            prompt = out.prompt_token_ids
            prompt_lps = list(out.prompt_logprobs or [None] * len(prompt))
            text, ids, lps = v.echo_text + text, [*prompt, *ids], [*prompt_lps, *lps]
        return text, ids, lps

    def _completion_logprobs(self, ids: list[int], lps: list, offset: int
                             ) -> dict[str, list] | None:
        if self.view.logprobs is None:
            return None
        return completion_logprobs(ids, lps, self.view.logprobs, self._text, offset)

    # ---- stream chunks ------------------------------------------------------------------
    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def role_chunks(self, n: int) -> list[dict[str, Any]]:
        """Chat streams open with the assistant role and empty content, per choice."""
        return [{**self._head(self._chunk_object),
                 "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]} for i in range(n)]

    def chunk(self, out: RequestOutput) -> dict[str, Any] | None:
        """The chunk of one output of one choice; None when it shows nothing new."""
        first = out.index not in self._offset
        self._count(out)
        wants_logprobs = self.view.logprobs is not None
        if not (out.new_text or out.finished or first and self.view.echo_text is not None
                or wants_logprobs and out.new_token_ids):
            return None
        choice: dict[str, Any] = {"index": out.index}
        called = False
        if self.chat and self.view.tools is not None:
            choice["delta"], called = self._tool_delta(out)
            if not (choice["delta"] or out.finished or wants_logprobs and out.new_token_ids):
                return None
        elif self.chat:
            choice["delta"] = {"content": out.new_text}
        if self.chat:
            choice["logprobs"] = chat_logprobs(out.new_logprobs or [], self.view.logprobs,
                                               self._text) if wants_logprobs else None
        else:
            text, ids, lps = self._completion_part(out, out.new_text, out.new_token_ids,
                                                   out.new_logprobs, echo=first)
            # text_offset continues from the tokens shown before, as a whole response's
            # does (the sum of the tokens' lengths: vLLM's rule)
            offset = self._offset.get(out.index, 0)
            logprobs = self._completion_logprobs(ids, lps, offset)
            choice["text"] = text
            choice["logprobs"] = logprobs
            shown = logprobs["tokens"] if logprobs is not None else []
            self._offset[out.index] = offset + sum(len(t) for t in shown)
        self._offset.setdefault(out.index, 0)
        choice["finish_reason"] = finish_reason(out, called)
        if out.finished:
            choice["stop_reason"] = None
        chunk = {**self._head(self._chunk_object), "choices": [choice]}
        if self.view.continuous_usage:
            chunk["usage"] = self.usage()
        return chunk

    def _tool_delta(self, out: RequestOutput) -> tuple[dict[str, Any], bool]:
        """The chat delta of a request with tools: new content and tool-call entries."""
        assert self.view.tools is not None
        stream = self._calls.setdefault(out.index, ToolCallStream(self.view.tools))
        content, calls = stream.feed(out.new_text)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta, stream.called

    def usage_chunk(self) -> dict[str, Any]:
        """``stream_options.include_usage``: the last chunk, with no choices."""
        return {**self._head(self._chunk_object), "choices": [], "usage": self.usage()}
