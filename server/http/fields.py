"""The field table of the OpenAI-compatible routes: every OpenAI or vLLM request field that
changes the output is honoured (declared in protocol.py) or refused here with a 400 naming
it, unless its value is neutral (what the field's default does, so clients that always
send defaults keep working). Fields that cannot change the output are ignored quietly;
names nobody defines are ignored with a logged warning, as vLLM does.

docs/sampling-api.md shows the same table to users; tests/server/test_http_fields.py sends
every row.
"""

from __future__ import annotations

import logging
from typing import Any

from .protocol import RequestBody

log = logging.getLogger(__name__)

# name -> the neutral values (JSON null is always neutral: it means unset)
SHARED_REFUSED: dict[str, tuple[Any, ...]] = {
    # vLLM 0.12 replaced these with structured_outputs (honoured: response_format.py)
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    # changes the whitespace of JSON answers, so refused (a null is neutral); the request's
    # whitespace is structured_outputs' disable_any_whitespace / max_whitespace
    "guided_whitespace_pattern": (),
    "structural_tag": (),
    # vLLM's sampling extras not implemented
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "logits_processors": ([],),
    "vllm_xargs": ({},),
    "return_token_ids": (False,),
    "prompt_embeds": (),
    # llama.cpp's per-request adapters and scales: one adapter per request here (``model``),
    # its scale ``lora_scale`` (vLLM's name)
    "lora": ([],),
}
COMPLETION_REFUSED: dict[str, tuple[Any, ...]] = {
    **SHARED_REFUSED,
    "suffix": ("",),
    "add_special_tokens": (True,),  # the completions default: the tokenizer adds BOS
}
CHAT_REFUSED: dict[str, tuple[Any, ...]] = {
    **SHARED_REFUSED,
    "functions": ([],),  # OpenAI's deprecated forms of tools and tool_choice
    "function_call": ("none",),
    "echo": (False,),  # vLLM's chat echo: the last message's content prepended
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "add_special_tokens": (False,),  # the chat default: the template writes BOS
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "documents": ([],),
    "mm_processor_kwargs": ({},),
    "modalities": (["text"],),
    "audio": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
}
# known names that cannot change the output: accepted and not used
IGNORED = frozenset({
    "user", "service_tier", "store", "metadata", "priority", "request_id", "cache_salt",
    "kv_transfer_params", "prediction", "guided_decoding_backend", "disable_fallback",
    "return_reasoning",
})


def check_fields(body: RequestBody, refused: dict[str, tuple[Any, ...]]) -> None:
    """ValueError (a 400) naming every refused field set to a non-neutral value; a logged
    warning naming the fields nobody defines."""
    extra = body.model_extra or {}
    bad = [name for name, value in extra.items()
           if name in refused and value is not None and value not in refused[name]]
    if bad:
        hints = "; ".join(_hint(name, refused[name]) for name in bad)
        raise ValueError(f"{', '.join(bad)}: not supported by loraplex ({hints})")
    unknown = sorted(name for name in extra if name not in refused and name not in IGNORED)
    if unknown:
        log.warning("the request's fields %s are unknown to loraplex and ignored", unknown)


# refused names that have a successor: the hint names it
REPLACED = {"guided_json": "structured_outputs.json", "guided_regex": "structured_outputs.regex",
            "guided_choice": "structured_outputs.choice",
            "guided_grammar": "structured_outputs.grammar",
            "guided_whitespace_pattern": "structured_outputs.max_whitespace",
            "functions": "tools", "function_call": "tool_choice",
            "lora": "model (the adapter) and lora_scale"}


def _hint(name: str, neutral: tuple[Any, ...]) -> str:
    if name in REPLACED:
        return f"send {REPLACED[name]} instead"
    values = " or ".join(repr(v) for v in neutral)
    return f"leave {name} unset" + (f" or send {values}" if values else "")
