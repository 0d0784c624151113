"""What a request asks the model to continue: text, token ids or chat turns, resolved to
what the engine takes. Front-neutral: gRPC's GenerateRequest and HTTP's completions and
chat requests all come through ``resolve_prompt``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..engine.llm_engine import Prompt
from .chat import ChatTurn, chat_ids, chat_prompt_ids

__all__ = ["Prompt", "resolve_prompt"]


def resolve_prompt(tokenizer: Any | None, text: str | None = None,
                   token_ids: Sequence[int] | None = None,
                   turns: Sequence[ChatTurn] | None = None,
                   apply_chat_template: bool = False,
                   tools: list[dict[str, Any]] | None = None) -> Prompt:
    """Exactly one of ``text``, ``token_ids`` and ``turns`` (empty counts as unset); chat
    turns, or text with ``apply_chat_template``, go through the chat template (with the
    ``tools`` it offers the model, if any). ValueError
    (INVALID_ARGUMENT) saying what to send otherwise."""
    given = [name for name, value in (("prompt", text), ("prompt_token_ids", token_ids),
                                      ("messages", turns)) if value]
    if len(given) > 1:
        both = "both" if len(given) == 2 else "all"
        raise ValueError(f"{' and '.join(given)} are {both} set: give exactly one of prompt, "
                         "prompt_token_ids and messages")
    if not given:
        raise ValueError("the request has no prompt: set prompt (text), prompt_token_ids or "
                         "messages (chat)")
    if turns:
        return chat_ids(tokenizer, turns, tools)
    if apply_chat_template:
        if not text:
            raise ValueError("apply_chat_template needs a text prompt, not prompt_token_ids")
        return chat_prompt_ids(tokenizer, text)
    return text if text else [int(t) for t in token_ids or ()]
