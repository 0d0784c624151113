"""A user prompt wrapped in the model's chat template, as token ids."""

from __future__ import annotations

from typing import Any


def chat_prompt_ids(tokenizer: Any | None, prompt: str) -> list[int]:
    """``prompt`` as one user message plus the generation prompt; ValueError if the model has
    no tokenizer or no chat template."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so no chat template: send "
                         "prompt_token_ids without apply_chat_template")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template: send a plain prompt "
                         "(apply_chat_template false; `loraplex generate --no-chat-template`)")
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, tokenize=False)
    # The template writes any BOS itself; tokenizing must not add another.
    return list(tokenizer(text, add_special_tokens=False).input_ids)
