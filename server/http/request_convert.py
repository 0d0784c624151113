"""HTTP request bodies -> the engine's RequestInput (engine/input_processor.py), and the
View that tells responses.py how to show its outputs. Runs on the engine's InputProcessor
thread, in the same hop as the InputProcessor's checks (server/generation.py ``check``):
it tokenizes and renders chat templates, never on the loop.

The prompt rules (server/prompt.py), the chat template (server/chat.py) and every value
check of the engine are the ones gRPC uses; here OpenAI's / vLLM's field names are
translated, the field table applied (fields.py), and the checks that only exist on HTTP
made with vLLM's rules (``best_of``, ``echo``, ``top_logprobs`` without ``logprobs``,
``prompt_logprobs`` with streaming). ``max_tokens`` against the context is the
InputProcessor's one check, in vLLM's words (``RequestInput.max_tokens_field``); so are the
logit_bias keys (SamplingParams: their form; the InputProcessor: the vocabulary)."""

from __future__ import annotations

import json
from typing import Any

from ...engine.input_processor import RequestInput
from ...engine.sampling_params import SamplingParams
from ...structured.constraint import StructuredOutputs
from ..chat import ChatTurn
from ..prompt import resolve_prompt
from .fields import CHAT_REFUSED, COMPLETION_REFUSED, check_fields
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from .response_format import request_constraint
from .responses import View
from .tools import plan_tools

_OPTIONAL = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
             "lora_scale")


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None,
                    constraint: StructuredOutputs | None = None) -> SamplingParams:
    """OpenAI's / vLLM's names -> the engine's; unset fields keep the engine's defaults.
    ``constraint``: the answer's constraint when it is not the body's own (a tool call)."""
    top_k = None if req.top_k in (None, -1, 0) else req.top_k
    given = {name: getattr(req, name) for name in _OPTIONAL if getattr(req, name) is not None}
    return SamplingParams(
        structured_outputs=constraint if constraint is not None else
        request_constraint(req.response_format, req.structured_outputs),
        temperature=req.temperature, top_p=req.top_p, top_k=top_k, seed=req.seed,
        max_new_tokens=max_tokens, min_new_tokens=req.min_tokens,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        n=1 if req.n is None else req.n, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=req.logit_bias or None, allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words or None, **given)


def _check_common(req: SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise ValueError("stream_options is only allowed with stream=true")
    if req.prompt_logprobs is not None and req.stream:
        raise ValueError("prompt_logprobs is not available with stream=true (as in vLLM)")


def _continuous_usage(req: SamplingFields) -> bool:
    return req.stream_options is not None and req.stream_options.continuous_usage_stats


def _one_prompt(prompt: Any) -> str | list[int]:
    """A text or a token-id list; a batch of exactly one is unwrapped."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ValueError(f"prompt holds {len(prompt)} prompts; loraplex takes one prompt "
                             "per request (text or a list of token ids)")
        return prompt[0]
    return prompt


def _token_ids(tokenizer: Any | None, text: str) -> list[int]:
    """A text prompt as the engine tokenizes it (LLMEngine.tokenize: special tokens on)."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: give the prompt as token ids")
    return list(tokenizer(text).input_ids)


def completion_input(req: CompletionRequest, tokenizer: Any | None, request_id: str
                     ) -> tuple[RequestInput, View]:
    check_fields(req, COMPLETION_REFUSED)
    _check_common(req)
    if req.best_of not in (None, 1):
        raise ValueError(f"best_of={req.best_of}: not supported (vLLM V1 dropped it too); "
                         "ask for n choices with logprobs and rank them by their logprobs")
    if req.max_tokens == 0 and not req.echo:
        raise ValueError("max_tokens=0 is only allowed with echo=true (the prompt alone); "
                         "give max_tokens >= 1")
    prompt = _one_prompt(req.prompt)
    if prompt == "" or prompt == []:
        raise ValueError("the prompt is empty: give at least one token")
    ids = resolve_prompt(tokenizer, *((prompt, None) if isinstance(prompt, str)
                                      else (None, prompt)))
    ids = _token_ids(tokenizer, ids) if isinstance(ids, str) else ids
    echo_only = bool(req.echo) and req.max_tokens == 0
    # vLLM: echo brings the prompt's logprobs (as many as asked per generated token)
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None and prompt_logprobs is None:
        prompt_logprobs = req.logprobs
    params = sampling_params(req, 1 if echo_only else req.max_tokens, req.logprobs,
                             prompt_logprobs)
    echo_text = None
    if req.echo:
        echo_text = prompt if isinstance(prompt, str) else _decode(tokenizer, ids)
    view = View(chat=False, logprobs=req.logprobs, echo_text=echo_text, echo_only=echo_only,
                prompt_logprobs=req.prompt_logprobs is not None,
                token_ids_as_text=bool(req.return_tokens_as_token_ids),
                continuous_usage=_continuous_usage(req))
    return RequestInput(ids, params, req.model or "", request_id, "max_tokens"), view


def _decode(tokenizer: Any | None, ids: list[int]) -> str:
    if tokenizer is None:
        raise ValueError("echo needs the model's tokenizer to show a token-id prompt")
    return tokenizer.decode(ids)


def chat_turns(messages: list[ChatMessage]) -> list[ChatTurn]:
    return [_turn(i, m) for i, m in enumerate(messages)]


def _turn(i: int, m: ChatMessage) -> ChatTurn:
    """As vLLM renders a message: content always a string ("" for null or missing: the
    SDK's assistant turn with tool_calls has none, and templates read ``message.content``);
    an assistant's calls with their arguments as objects (what templates such as Qwen's
    write back with ``tojson``); an empty ``tool_calls`` left out."""
    extra: dict[str, Any] = {k: v for k, v in (("tool_call_id", m.tool_call_id),
                                               ("name", m.name)) if v is not None}
    if m.tool_calls:
        extra["tool_calls"] = [_template_call(i, call) for call in m.tool_calls]
    return ChatTurn(m.role, m.text(), tuple(extra.items()))


def _template_call(i: int, call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"messages[{i}].tool_calls: each call needs function.name")  # noqa: TRY004 (a 400, as every bad field)
    arguments = function.get("arguments")
    if arguments is None:  # as vLLM: no arguments are none
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            raise ValueError(f"messages[{i}].tool_calls: function.arguments of "
                             f"{function['name'][:64]!r} is not valid JSON") from None
    return {**call, "function": {**function, "arguments": arguments}}


def chat_input(req: ChatCompletionRequest, tokenizer: Any | None, request_id: str,
               auto_tool_parser: str | None = None) -> tuple[RequestInput, View]:
    """``auto_tool_parser``: the server's --tool-call-parser with --enable-auto-tool-choice
    (tools.py)."""
    check_fields(req, CHAT_REFUSED)
    _check_common(req)
    if not req.messages:
        raise ValueError("messages is empty: give at least one {role, content} message")
    if req.top_logprobs not in (None, 0) and not req.logprobs:
        raise ValueError(f"top_logprobs={req.top_logprobs} needs logprobs=true")
    if req.top_logprobs is not None and req.top_logprobs < -1:
        raise ValueError(f"top_logprobs={req.top_logprobs} must be >= 0, or -1 for the whole "
                         "vocabulary")
    name, max_tokens = ("max_completion_tokens", req.max_completion_tokens) \
        if req.max_completion_tokens is not None else ("max_tokens", req.max_tokens)
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, auto_tool_parser)
    ids = resolve_prompt(tokenizer, turns=chat_turns(req.messages),
                         tools=tools.template_tools if tools is not None else None)
    assert isinstance(ids, list)  # chat turns come back as token ids
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    tool_constraint = tools.constraint if tools is not None else None
    if tool_constraint is not None and \
            request_constraint(req.response_format, req.structured_outputs) is not None:
        raise ValueError("tool_choice already constrains the answer to a tool call: leave "
                         "response_format and structured_outputs unset")
    params = sampling_params(req, max_tokens, logprobs, req.prompt_logprobs, tool_constraint)
    view = View(chat=True, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs is not None,
                token_ids_as_text=bool(req.return_tokens_as_token_ids),
                continuous_usage=_continuous_usage(req), tools=tools)
    return RequestInput(ids, params, req.model or "", request_id, name), view
