"""BadWords, the per-request index of the bad words, bans exactly what vLLM's scan over every
word bans; the words are tokenized in one batched call exactly as vLLM tokenizes them one by
one; a request's bans and its fixed token lists reach the sampler as before."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from loraplex.engine.bad_words import BadWords
from loraplex.engine.request_checks import bad_word_ids
from loraplex.engine.sampling_batch import banned_tokens, build_batch
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import Sequence

from tests.structured_fixtures import make_byte_tokenizer


def scan(words: list[list[int]], outputs: list[int]) -> set[int]:
    """The scan the index replaces (vLLM's ``_apply_bad_words_single_batch``): every word,
    every step."""
    out = set()
    for word in words:
        prefix = len(word) - 1
        if prefix <= len(outputs) and (prefix == 0 or outputs[-prefix:] == word[:-1]):
            out.add(word[-1])
    return out


def indexed(words: list[list[int]], outputs: list[int]) -> set[int]:
    index = BadWords(words)
    return set(index.always) | set(index.banned(outputs))


def test_the_index_bans_exactly_what_the_scan_bans() -> None:
    """Random word lists over a small alphabet (so prefixes share tokens and match often),
    random outputs, many of them ending with some word's prefix."""
    rng = random.Random(0)
    for _ in range(3000):
        alphabet = rng.randint(2, 8)
        words = [[rng.randrange(alphabet) for _ in range(rng.randint(1, 6))]
                 for _ in range(rng.randint(1, 12))]
        outputs = [rng.randrange(alphabet) for _ in range(rng.randint(0, 10))]
        if words and rng.random() < 0.5:  # end with a word's prefix
            word = rng.choice(words)
            outputs += word[:rng.randint(0, len(word) - 1)]
        assert indexed(words, outputs) == scan(words, outputs), (words, outputs)


def test_edge_cases() -> None:
    assert indexed([], [1, 2]) == set()
    assert indexed([[]], [1]) == set()  # a word with no tokens bans nothing
    assert indexed([[5], [5], [3, 5]], []) == {5}  # duplicates, a prefix not yet written
    assert indexed([[1, 2, 3]], [1]) == set()  # only part of the prefix
    assert indexed([[1, 2, 3]], [9, 1, 2]) == {3}
    assert indexed([[1, 2, 3], [2, 4], [2, 5]], [1, 2]) == {3, 4, 5}  # nested prefixes
    assert indexed([[7, 7, 7]], [7, 7, 7, 7]) == {7}


def test_a_step_walks_only_the_match() -> None:
    """100,000 two-token words: what a step bans comes from the one prefix that matches,
    whatever the number of words (the old scan looked at all of them)."""
    words = [[i, i + 1] for i in range(0, 200_000, 2)]
    index = BadWords(words)
    assert index.banned([5, 6]) == [7]
    assert index.banned([1]) == []  # 1 starts no word
    assert index.always == ()


def test_long_words_take_two_nodes_each_at_most() -> None:
    """Words of hundreds of tokens: the trie's edges hold runs of tokens (4 bytes each), so
    its nodes stay at most two a word, and it still bans what the scan bans, also where
    long prefixes share their ends and differ further back."""
    rng = random.Random(1)
    tail = [rng.randrange(50_000) for _ in range(300)]
    words = [[rng.randrange(50_000) for _ in range(rng.randint(2, 400))] + tail[:k] + [k]
             for k in range(1, 200)]
    index = BadWords(words)
    assert index.nodes() <= 2 * len(words) + 1
    for word in words[::7]:
        for cut in (len(word) - 1, len(word) - 2, 3):
            outputs = [1, 2, *word[:cut]]
            assert indexed(words, outputs) == scan(words, outputs)


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_byte_tokenizer(tmp_path_factory.mktemp("bpe")))


def one_by_one(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's ``update_from_tokenizer``, a tokenizer call per word and form."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def test_batched_tokenizing_is_vllms(byte_tokenizer, tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    words = ["name", " value", "  \"key\": 12", "x", "héllo wörld", "{}", "the cat", "name"]
    got = bad_word_ids(byte_tokenizer, words)
    assert got == one_by_one(byte_tokenizer, words)
    assert any(len(w) > 1 for w in got)  # multi-token words, and spaced forms, occur
    assert len(got) > len(words)
    word_level = AutoTokenizer.from_pretrained(tiny_llama)
    assert bad_word_ids(word_level, words) == one_by_one(word_level, words)


def test_the_batch_bans_and_masks_as_the_fields_say() -> None:
    """Through build_batch: the one-token words, the prefix matches, min_new_tokens' stop
    ids, logit_bias and allowed_token_ids, each on its own row (tensors made once per
    request and shared by its choices)."""
    vocab = 16
    a = Sequence(request_id="a", prompt_token_ids=[1], params=SamplingParams(
        min_new_tokens=2, stop_token_ids=[9], logit_bias={3: 1.5, 4: -2.0}),
        eos_token_ids=frozenset({2}))
    a.output_token_ids = [5]
    b = Sequence(request_id="b", prompt_token_ids=[1],
                 params=SamplingParams(allowed_token_ids=[6, 7, 8]))
    b.bad_words = BadWords([[11], [5, 12], [6, 13]])
    b.output_token_ids = [6]
    batch = build_batch([a, b], vocab, torch.device("cpu"))
    rows, ids = batch.banned
    assert sorted(zip(rows.tolist(), ids.tolist())) == [(0, 2), (0, 9), (1, 11), (1, 13)]
    assert sorted(banned_tokens(b)) == [13]  # the per-step part only
    rows, ids, values = batch.bias
    assert list(zip(rows.tolist(), ids.tolist(), values.tolist())) == [(0, 3, 1.5),
                                                                        (0, 4, -2.0)]
    rs, mask = batch.allowed
    assert rs.index == [1] and mask[0].nonzero().flatten().tolist() == [6, 7, 8]
    made = b.row_tokens
    build_batch([a, b], vocab, torch.device("cpu"))
    assert b.row_tokens is made  # made once
    assert b.fork(1).row_tokens is made and b.fork(1).bad_words is b.bad_words
