"""The engine's TokenLogprobs in the shapes OpenAI's and vLLM's clients read:

- completions ``logprobs``: ``{tokens, token_logprobs, top_logprobs, text_offset}``; each
  ``top_logprobs`` entry maps the token itself, then the k most likely, to their logprobs
  (vLLM's: so k or k+1 entries); a position without a logprob (the first prompt token
  under ``echo``) is ``null`` in both lists;
- chat ``logprobs``: ``{content: [{token, logprob, bytes, top_logprobs: [k most likely]}]}``;
- vLLM's ``prompt_logprobs``: one ``{token_id: {logprob, rank, decoded_token}}`` per prompt
  token, ``null`` for the first.

``-inf`` becomes -9999.0 (JSON has no infinity; OpenAI's and vLLM's value). Tokens are each
id decoded alone, or ``token_id:N`` with vLLM's ``return_tokens_as_token_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


@dataclass
class TokenText:
    """How a token id is shown."""

    tokenizer: Any | None
    as_ids: bool = False  # vLLM's return_tokens_as_token_ids

    def __call__(self, token_id: int) -> str:
        if self.as_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


def completion_logprobs(token_ids: Sequence[int], lps: Sequence[Any | None], k: int,
                        text: TokenText, offset: int = 0) -> dict[str, list]:
    """``lps[i]`` is token_ids[i]'s TokenLogprob (None: it has none); ``offset``: where the
    first token's text starts in the choice's text."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token_id, lp in zip(token_ids, lps):
        token = text(token_id)
        text_offset.append(offset)
        offset += len(token)
        tokens.append(token)
        if lp is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_value(lp.logprob))
        top = {token: _value(lp.logprob)}
        for alt_id, alt in _top(lp.top, k):
            top.setdefault(text(alt_id), _value(alt))
        top_logprobs.append(top)
    return {"text_offset": text_offset, "token_logprobs": token_logprobs, "tokens": tokens,
            "top_logprobs": top_logprobs}


def _top(top: Sequence[Any], k: int) -> Sequence[Any]:
    """The k most likely of ``top`` (best first); k = -1: all of them (the engine gave the
    whole vocabulary)."""
    return top if k < 0 else top[:k]


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _value(logprob),
            "bytes": list(token.encode("utf-8", errors="replace"))}


def chat_logprobs(lps: Sequence[Any], k: int, text: TokenText) -> dict[str, list]:
    """OpenAI's chat form for the generated tokens ``lps`` (their TokenLogprobs)."""
    content = []
    for lp in lps:
        entry = _entry(text(lp.token_id), lp.logprob)
        entry["top_logprobs"] = [_entry(text(t), v) for t, v in _top(lp.top, k)]
        content.append(entry)
    return {"content": content}


def prompt_logprobs(lps: Sequence[Any | None] | None, text: TokenText
                    ) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: the prompt token itself first, then its top-k by rank."""
    if lps is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): {"logprob": _value(lp.logprob), "rank": lp.rank,
                                    "decoded_token": text(lp.token_id)}}
        for rank, (t, v) in enumerate(lp.top, start=1):
            entry.setdefault(str(t), {"logprob": _value(v), "rank": rank,
                                      "decoded_token": text(t)})
        out.append(entry)
    return out
