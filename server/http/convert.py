"""HTTP request bodies -> the front-neutral GenerateInput (server/generation.py). The
prompt rules (server/prompt.py), the chat template (server/chat.py) and every value check
of the engine are the ones gRPC uses; only OpenAI's field names are translated here."""

from __future__ import annotations

from typing import Any

from ...engine.sampling_params import SamplingParams
from ..chat import ChatTurn
from ..generation import GenerateInput
from ..prompt import resolve_prompt
from .protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    RequestBody,
    SamplingFields,
)


def check_supported(req: RequestBody) -> None:
    unsupported = req.unsupported()
    if unsupported:
        raise ValueError(f"{', '.join(unsupported)}: not supported by loraplex; leave "
                         f"{'it' if len(unsupported) == 1 else 'them'} unset")


def _check_choices(req: SamplingFields) -> None:
    if req.n != 1:
        raise ValueError(f"n={req.n}: loraplex returns one choice per request; send n=1 "
                         "(or several requests)")
    if req.stream_options is not None and not req.stream:
        raise ValueError("stream_options is only allowed with stream=true")


def sampling_params(req: SamplingFields, max_tokens: int | None) -> SamplingParams:
    """OpenAI's / vLLM's names -> the engine's; unset fields keep the model's defaults."""
    top_k = None if req.top_k in (None, -1, 0) else req.top_k
    return SamplingParams(
        temperature=req.temperature, top_p=req.top_p, top_k=top_k, seed=req.seed,
        max_new_tokens=max_tokens, min_new_tokens=req.min_tokens,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos)


def _one_prompt(prompt: Any) -> str | list[int]:
    """A text or a token-id list; a batch of exactly one is unwrapped."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ValueError(f"prompt holds {len(prompt)} prompts; loraplex takes one prompt "
                             "per request (text or a list of token ids)")
        return prompt[0]
    return prompt


def completion_input(req: CompletionRequest, tokenizer: Any | None, request_id: str
                     ) -> GenerateInput:
    check_supported(req)
    _check_choices(req)
    prompt = _one_prompt(req.prompt)
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
    if text == "" or ids == []:
        raise ValueError("the prompt is empty: give at least one token")
    resolved = resolve_prompt(tokenizer, text, ids)
    return GenerateInput(resolved, sampling_params(req, req.max_tokens), req.model or "",
                         request_id)


def chat_turns(messages: list[ChatMessage]) -> list[ChatTurn]:
    return [ChatTurn(m.role, m.text()) for m in messages]


def chat_input(req: ChatCompletionRequest, tokenizer: Any | None, request_id: str
               ) -> GenerateInput:
    check_supported(req)
    _check_choices(req)
    if not req.messages:
        raise ValueError("messages is empty: give at least one {role, content} message")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    prompt = resolve_prompt(tokenizer, turns=chat_turns(req.messages))
    return GenerateInput(prompt, sampling_params(req, max_tokens), req.model or "", request_id)
