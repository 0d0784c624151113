"""The checks of a request's sampling fields that need the engine (its settings, the
vocabulary, the tokenizer): the InputProcessor (engine/input_processor.py) runs them after
``SamplingParams.validate``. Each raises InvalidRequestError naming the field; the caps on
the list fields also name the cap and its flag. They are the one check of every front
(gRPC, HTTP, the Python API)."""

from __future__ import annotations

from ..errors import InvalidRequestError
from .bad_words import BadWords
from .engine_config import EngineConfig
from .sampling_params import ALL_LOGPROBS, SamplingParams


def check_vocab(ids: list[int], what: str, vocab: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(
            f"{what} holds token id {bad[0]}, out of range: ids must be in [0, {vocab})")


def _over(field: str, count: int, what: str, cap: int, flag: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field} has {count} {what}; the server allows at most {cap} "
                               f"(--{flag})")


def check_limits(params: SamplingParams, config: EngineConfig, vocab: int) -> None:
    """The caps on the list fields (engine/engine_config.py's request limits): cheap length checks,
    made before anything costly (tokenizing the prompt or the bad words)."""
    counts = (("stop", len(params.stop), "strings", config.max_stop_strings,
               "max-stop-strings"),
              ("stop_token_ids", len(params.stop_token_ids), "ids", config.max_stop_token_ids,
               "max-stop-token-ids"),
              ("bad_words", len(params.bad_words or ()), "words", config.max_bad_words,
               "max-bad-words"),
              ("logit_bias", len(params.logit_bias or {}), "entries", config.max_logit_bias,
               "max-logit-bias"),
              ("allowed_token_ids", len(params.allowed_token_ids or ()), "ids",
               config.max_allowed_token_ids or vocab, "max-allowed-token-ids"))
    for field, count, what, cap, flag in counts:
        if count > cap:
            raise _over(field, count, what, cap, flag)
    for field, words in (("stop", params.stop), ("bad_words", params.bad_words or ())):
        for i, word in enumerate(words):
            if len(word) > config.max_word_chars:
                raise _over(f"{field}[{i}]", len(word), "characters", config.max_word_chars,
                            "max-word-chars")
    chars = sum(map(len, params.bad_words or ()))
    if chars > config.max_bad_words_chars:
        raise _over("bad_words", chars, "characters in all", config.max_bad_words_chars,
                    "max-bad-words-chars")


def check_sampling(params: SamplingParams, config: EngineConfig, vocab: int
                   ) -> dict[str, int]:
    """``--max-logprobs``, ``--max-num-seqs`` and the vocabulary against the fields. Returns
    the resolved ``logprobs`` / ``prompt_logprobs`` (-1, the whole vocabulary, becomes its
    count), for the caller's ``dataclasses.replace``."""
    resolved: dict[str, int] = {}
    cap = vocab if config.max_logprobs == ALL_LOGPROBS else config.max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is None:
            continue
        if k == ALL_LOGPROBS and vocab > cap:
            raise InvalidRequestError(
                f"{name}=-1 asks for all {vocab} tokens of the vocabulary; the server allows "
                f"at most {cap} (--max-logprobs; -1 there lifts the cap)")
        if k > cap:
            limit = f"{cap}" if cap == config.max_logprobs else f"-1 (the vocabulary, {cap})"
            raise InvalidRequestError(f"{name}={k} is over the server's --max-logprobs={limit}")
        resolved[name] = vocab if k == ALL_LOGPROBS else min(k, vocab)
    if params.n > config.max_num_seqs:
        raise InvalidRequestError(
            f"n={params.n} is over --max-num-seqs={config.max_num_seqs}: the n choices run "
            "at once")
    if params.logit_bias:
        check_vocab(list(params.logit_bias), "logit_bias", vocab)
    if params.allowed_token_ids is not None:
        check_vocab(params.allowed_token_ids, "allowed_token_ids", vocab)
    return resolved


def tokenize_bad_words(tokenizer: object | None, words: list[str] | None,
                       vocab: int) -> BadWords | None:
    """The bad words tokenized (``bad_word_ids``), checked against the vocabulary and
    indexed for the sampler; None without words."""
    if not words:
        return None
    if tokenizer is None:
        raise InvalidRequestError("bad_words: this model has no tokenizer")
    ids = bad_word_ids(tokenizer, words)
    check_vocab([t for word in ids for t in word], "bad_words", vocab)
    return BadWords(ids)


def bad_word_ids(tokenizer: object, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids, without and (where it tokenizes as a new word of the same
    length) with a leading space: vLLM's ``SamplingParams.update_from_tokenizer``, in one
    batched tokenizer call. A word with no tokens bans nothing."""
    stripped = [w.lstrip() for w in words]
    encoded = tokenizer([*stripped, *(" " + w for w in stripped)],  # type: ignore[operator]
                        add_special_tokens=False).input_ids
    out: list[list[int]] = []
    for plain, spaced in zip(encoded[:len(words)], encoded[len(words):]):
        if not plain:
            continue
        out.append(list(plain))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(list(spaced))
    return out
