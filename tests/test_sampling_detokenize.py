"""Incremental detokenization (vLLM's prefix / read offsets) gives the full decode's text,
character for character, on the embedded model's byte-level BPE (half UTF-8 characters,
special tokens) and on the tiny word-level tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from loraplex.engine.detokenizer import detokenize, flush
from loraplex.engine.models.embedded import ensure_default_model
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import Sequence
from transformers import AutoTokenizer


def incremental(tokenizer, ids: list[int]) -> tuple[str, list[str]]:
    """(final text, the text after each token) fed one token at a time."""
    seq = Sequence(request_id="r", prompt_token_ids=[1], params=SamplingParams())
    texts = []
    for t in ids:
        seq.append_token(t)
        detokenize(tokenizer, seq)
        texts.append(seq.text)
    flush(tokenizer, seq)
    return seq.text, texts


def cases(tokenizer, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    text = "Héllo wörld — ünïcode 日本語のテキスト 🙂🙂 don't , . ?! 42\n  spaced  out"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    special = sorted(tokenizer.all_special_ids)
    return [ids, ids + special[:1] + ids, [rng.randrange(vocab) for _ in range(200)],
            special + ids[:5] + special]


@pytest.mark.parametrize("which", ["smollm2", "tiny"])
def test_incremental_equals_the_full_decode(which: str, tiny_llama: Path) -> None:
    path = ensure_default_model() if which == "smollm2" else tiny_llama
    tokenizer = AutoTokenizer.from_pretrained(path)
    for ids in cases(tokenizer, len(tokenizer)):
        final, texts = incremental(tokenizer, ids)
        assert final == tokenizer.decode(ids, skip_special_tokens=True)
        for j, text in enumerate(texts):  # the text so far is always a prefix of the end's
            assert final.startswith(text), j
