"""Chat turns wrapped in the model's chat template, as token ids: the one path that gRPC
(``messages``, ``apply_chat_template``) and HTTP (``/v1/chat/completions``) share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2

# The roles OpenAI's chat API defines; what a role means is up to the model's template.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str  # never None: transformers drops None keys, and templates read it
    # OpenAI's other message fields, as the template reads them: an assistant turn's
    # ``tool_calls`` (arguments as objects), a tool turn's ``tool_call_id`` and ``name``
    extra: tuple[tuple[str, Any], ...] = ()


def check_turns(turns: Sequence[ChatTurn]) -> list[dict[str, Any]]:
    """The turns as the template's ``messages``; ValueError naming a bad role or no turns."""
    if not turns:
        raise ValueError("messages is empty: give at least one {role, content} message")
    for i, turn in enumerate(turns):
        if turn.role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role is {turn.role[:64]!r}; allowed: "
                             f"{', '.join(CHAT_ROLES)}")
    return [{"role": t.role, "content": t.content, **dict(t.extra)} for t in turns]


def chat_ids(tokenizer: Any | None, turns: Sequence[ChatTurn],
             tools: list[dict[str, Any]] | None = None) -> list[int]:
    """``turns`` through the chat template plus the generation prompt, with ``tools`` (OpenAI's
    tool objects) when given; ValueError if the model has no tokenizer or no chat template,
    or a turn is bad."""
    messages = check_turns(turns)
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so no chat template: send "
                         "prompt_token_ids without chat messages")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template: send a plain prompt "
                         "(apply_chat_template false; `loraplex generate --no-chat-template`)")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools or None,
                                             add_generation_prompt=True, tokenize=False)
    except RecursionError:  # a tool's parameters (or a call's arguments) hundreds deep
        raise ValueError("the messages or tools nest too deeply for the chat template (a "
                         "tool's parameters schema may nest at most --max-schema-depth "
                         "levels)") from None
    except (jinja2.TemplateError, TypeError) as exc:  # the messages, not the server
        raise ValueError(f"the model's chat template cannot render these messages: "
                         f"{type(exc).__name__}: {str(exc)[:500]} (its raise_exception, or a "
                         "field or message order it needs)") from None
    # The template writes any BOS itself; tokenizing must not add another.
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def chat_prompt_ids(tokenizer: Any | None, prompt: str) -> list[int]:
    """``prompt`` as one user message plus the generation prompt (see ``chat_ids``)."""
    return chat_ids(tokenizer, [ChatTurn("user", prompt)])
