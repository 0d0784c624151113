"""Incremental detokenization with vLLM's prefix / read offsets (vLLM's
``detokenize_incrementally``): each new token decodes a few tokens of context, never the
whole output again.

``seq.text`` holds the output up to ``read_offset``; ``prefix_offset`` .. ``read_offset`` is
the context that makes the tokenizer's spacing and clean-up rules see what the full decode
sees. Text whose last character is an unfinished UTF-8 sequence waits for the next token
(``flush`` adds it when the sequence ends), so the final text is the full decode's.
"""

from __future__ import annotations

from .sequence import Sequence


def _decode(tokenizer: object, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True) if ids else ""


def _pending(tokenizer: object, seq: Sequence) -> tuple[str, str]:
    ids = seq.output_token_ids
    prefix = _decode(tokenizer, ids[seq.prefix_offset: seq.read_offset])
    return prefix, _decode(tokenizer, ids[seq.prefix_offset:])


def detokenize(tokenizer: object, seq: Sequence) -> None:
    """After a token was appended: add the text it completes to ``seq.text``."""
    prefix, full = _pending(tokenizer, seq)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        seq.text += full[len(prefix):]
        seq.prefix_offset, seq.read_offset = seq.read_offset, seq.num_output_tokens


def flush(tokenizer: object, seq: Sequence) -> None:
    """The sequence ends: what is still pending (a half character) joins the text."""
    prefix, full = _pending(tokenizer, seq)
    if seq.read_offset < seq.num_output_tokens:
        seq.text += full[len(prefix):]
        seq.prefix_offset, seq.read_offset = seq.read_offset, seq.num_output_tokens
