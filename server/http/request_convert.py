"""HTTP request bodies -> the front-neutral GenerateInput (server/generation.py), and the
View that tells responses.py how to show its outputs. Runs on the engine's
RequestProcessor thread (it tokenizes and renders chat templates), never on the loop.

The prompt rules (server/prompt.py), the chat template (server/chat.py) and every value
check of the engine are the ones gRPC uses; here OpenAI's / vLLM's field names are
translated, the field table applied (fields.py), and the checks that only exist on HTTP
made with vLLM's rules (``max_tokens`` against the context, ``best_of``, ``echo``,
``top_logprobs`` without ``logprobs``, ``prompt_logprobs`` with streaming)."""

from __future__ import annotations

import json
from typing import Any

from ...engine.sampling_params import SamplingParams
from ..chat import ChatTurn
from ..generation import GenerateInput
from ..prompt import resolve_prompt
from .fields import CHAT_REFUSED, COMPLETION_REFUSED, check_fields
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from .response_format import request_constraint
from .responses import View
from .tools import plan_tools

_OPTIONAL = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None
                    ) -> SamplingParams:
    """OpenAI's / vLLM's names -> the engine's; unset fields keep the engine's defaults."""
    top_k = None if req.top_k in (None, -1, 0) else req.top_k
    given = {name: getattr(req, name) for name in _OPTIONAL if getattr(req, name) is not None}
    return SamplingParams(
        structured_outputs=request_constraint(req.response_format, req.structured_outputs),
        temperature=req.temperature, top_p=req.top_p, top_k=top_k, seed=req.seed,
        max_new_tokens=max_tokens, min_new_tokens=req.min_tokens,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        n=1 if req.n is None else req.n, logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs,
        logit_bias=_logit_bias(req.logit_bias), allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words or None, **given)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """JSON object keys are strings: each must be a token id (the engine checks the range
    of ids and values)."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ValueError(f"logit_bias key {key[:32]!r} is not a token id (an integer "
                             "string)") from None
    return out


def _check_common(req: SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise ValueError("stream_options is only allowed with stream=true")
    if req.prompt_logprobs is not None and req.stream:
        raise ValueError("prompt_logprobs is not available with stream=true (as in vLLM)")


def _continuous_usage(req: SamplingFields) -> bool:
    return req.stream_options is not None and req.stream_options.continuous_usage_stats


def _check_max_tokens(name: str, max_tokens: int | None, ids: list[int], max_model_len: int
                      ) -> None:
    """vLLM's rule: a given max_tokens must fit beside the prompt (unset: the room left)."""
    if max_tokens is not None and len(ids) < max_model_len and \
            len(ids) + max_tokens > max_model_len:
        raise ValueError(
            f"{name}={max_tokens} is too large: this model's maximum context length is "
            f"{max_model_len} tokens and the request has {len(ids)} input tokens "
            f"({max_tokens} > {max_model_len} - {len(ids)})")


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


def completion_input(req: CompletionRequest, tokenizer: Any | None, max_model_len: int,
                     request_id: str) -> tuple[GenerateInput, View]:
    check_fields(req, COMPLETION_REFUSED)
    _check_common(req)
    if req.best_of not in (None, 1):
        raise ValueError(f"best_of={req.best_of}: not supported (vLLM V1 dropped it too); "
                         "ask for n choices with logprobs and rank them by their logprobs")
    if req.max_tokens == 0 and not req.echo:
        raise ValueError("max_tokens=0 is only allowed with echo=true (the prompt alone); "
                         "give max_tokens >= 1")
    if req.logprobs is not None and req.logprobs < -1:
        raise ValueError(f"logprobs={req.logprobs} must be >= 0 (0 = the token's own "
                         "logprob only), or -1 for the whole vocabulary")
    prompt = _one_prompt(req.prompt)
    if prompt == "" or prompt == []:
        raise ValueError("the prompt is empty: give at least one token")
    ids = resolve_prompt(tokenizer, *((prompt, None) if isinstance(prompt, str)
                                      else (None, prompt)))
    ids = _token_ids(tokenizer, ids) if isinstance(ids, str) else ids
    _check_max_tokens("max_tokens", req.max_tokens, ids, max_model_len)
    echo_only = bool(req.echo) and req.max_tokens == 0
    # vLLM: echo brings the prompt's logprobs (as many as asked per generated token)
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None and prompt_logprobs is None:
        prompt_logprobs = req.logprobs
    params = sampling_params(req, 1 if echo_only else req.max_tokens, req.logprobs)
    params.prompt_logprobs = prompt_logprobs
    echo_text = None
    if req.echo:
        echo_text = prompt if isinstance(prompt, str) else _decode(tokenizer, ids)
    view = View(chat=False, logprobs=req.logprobs, echo_text=echo_text, echo_only=echo_only,
                prompt_logprobs=req.prompt_logprobs is not None,
                token_ids_as_text=bool(req.return_tokens_as_token_ids),
                continuous_usage=_continuous_usage(req))
    return GenerateInput(ids, params, req.model or "", request_id), view


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


def chat_input(req: ChatCompletionRequest, tokenizer: Any | None, max_model_len: int,
               request_id: str, auto_tool_parser: str | None = None
               ) -> tuple[GenerateInput, View]:
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
    _check_max_tokens(name, max_tokens, ids, max_model_len)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens, logprobs)
    if tools is not None and tools.constraint is not None:
        if params.structured_outputs is not None:
            raise ValueError("tool_choice already constrains the answer to a tool call: leave "
                             "response_format and structured_outputs unset")
        params.structured_outputs = tools.constraint
    view = View(chat=True, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs is not None,
                token_ids_as_text=bool(req.return_tokens_as_token_ids),
                continuous_usage=_continuous_usage(req), tools=tools)
    return GenerateInput(ids, params, req.model or "", request_id), view
