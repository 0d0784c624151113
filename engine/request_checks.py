"""The checks of a request's sampling fields that need the engine (its settings, the
vocabulary, the tokenizer): LLMEngine.make_sequence runs them after
``SamplingParams.validate``. Each raises InvalidRequestError naming the field."""

from __future__ import annotations

from .config import EngineConfig
from .errors import InvalidRequestError
from .sampling_params import SamplingParams


def check_vocab(ids: list[int], what: str, vocab: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(
            f"{what} holds token id {bad[0]}, out of range: ids must be in [0, {vocab})")


def check_sampling(params: SamplingParams, config: EngineConfig, vocab: int) -> None:
    """``--max-logprobs``, ``--max-num-seqs`` and the vocabulary against the fields."""
    cap = config.max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > cap:
            raise InvalidRequestError(f"{name}={k} is over the server's --max-logprobs={cap}")
    if params.n > config.max_num_seqs:
        raise InvalidRequestError(
            f"n={params.n} is over --max-num-seqs={config.max_num_seqs}: the n choices run "
            "at once")
    if params.logit_bias:
        check_vocab(list(params.logit_bias), "logit_bias", vocab)
    if params.allowed_token_ids is not None:
        check_vocab(params.allowed_token_ids, "allowed_token_ids", vocab)


def tokenize_bad_words(tokenizer: object | None, words: list[str] | None,
                       vocab: int) -> list[list[int]]:
    """Each bad word's token ids, without and (where it tokenizes as a new word of the same
    length) with a leading space: vLLM's ``SamplingParams.update_from_tokenizer``."""
    if not words:
        return []
    if tokenizer is None:
        raise InvalidRequestError("bad_words: this model has no tokenizer")
    out: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    for ids in out:
        check_vocab(ids, "bad_words", vocab)
    return out
