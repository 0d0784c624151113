"""SamplingParams' sampling fields: validate() names the field and its range; the engine's
own checks (max_logprobs, max_num_seqs, the vocabulary) raise InvalidRequestError."""

from __future__ import annotations

from pathlib import Path

import pytest
from loraplex import LLMEngine, SamplingParams
from loraplex.errors import InvalidRequestError


@pytest.mark.parametrize("fields, named", [
    ({"n": 0}, "n=0"),
    ({"logprobs": -2}, "logprobs=-2"),  # -1 is valid: the whole vocabulary (vLLM's)
    ({"prompt_logprobs": -2}, "prompt_logprobs=-2"),
    ({"presence_penalty": 2.5}, "presence_penalty=2.5 must be in [-2, 2]"),
    ({"frequency_penalty": -2.01}, "frequency_penalty=-2.01 must be in [-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty=0.0"),
    ({"min_p": 1.5}, "min_p=1.5 must be in [0, 1]"),
    ({"min_p": -0.1}, "min_p=-0.1"),
    ({"logit_bias": {5: 101.0}}, "logit_bias[5]=101.0 must be in [-100, 100]"),
    ({"logit_bias": {-3: 1.0}}, "logit_bias key -3"),
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"bad_words": [" "]}, "bad_words"),
])
def test_validate_names_the_field(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        SamplingParams(**fields).validate()
    assert named in str(info.value)


def test_a_logit_bias_key_that_is_no_integer_is_refused() -> None:
    with pytest.raises(ValueError, match="logit_bias key 'x'"):
        SamplingParams(logit_bias={"x": 1.0})
    assert SamplingParams(logit_bias={"7": 2}).logit_bias == {7: 2}


def test_neutral_values_are_valid() -> None:
    SamplingParams(n=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                   min_p=0.0, logit_bias={}, logprobs=0, prompt_logprobs=0).validate()


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> LLMEngine:
    return LLMEngine(model=tiny_llama, dtype="float32", max_model_len=128, max_num_seqs=4,
                     max_logprobs=5)


@pytest.mark.parametrize("fields, named", [
    ({"logprobs": 6}, "logprobs=6 is over the server's --max-logprobs=5"),
    ({"prompt_logprobs": 6}, "prompt_logprobs=6 is over"),
    ({"n": 5}, "n=5 is over --max-num-seqs=4"),
    ({"logit_bias": {384: 1.0}}, "logit_bias holds token id 384"),
    ({"allowed_token_ids": [1, 999]}, "allowed_token_ids holds token id 999"),
])
def test_engine_checks_name_the_field(engine: LLMEngine, fields: dict, named: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request([5, 6, 7], SamplingParams(**fields))
    assert named in str(info.value)
    assert not engine.requests and engine.block_manager.num_used_blocks == 0


def test_the_engine_honours_bias_masks_and_bad_words(engine: LLMEngine) -> None:
    cat = engine.tokenizer.convert_tokens_to_ids("cat")
    greedy = {"temperature": 0.0, "max_new_tokens": 4, "min_new_tokens": 4}
    forced = engine.generate([[5, 6, 7]], SamplingParams(**greedy, logit_bias={cat: 100.0}))
    assert forced[0].token_ids == [cat] * 4
    banned = engine.generate([[5, 6, 7]], SamplingParams(**greedy, logit_bias={cat: 100.0},
                                                          bad_words=["cat"]))
    assert cat not in banned[0].token_ids
    allowed = engine.generate([[5, 6, 7]], SamplingParams(
        temperature=1.0, seed=0, max_new_tokens=6, min_new_tokens=6,
        allowed_token_ids=[40, 41]))
    assert set(allowed[0].token_ids) <= {40, 41}
    assert engine.block_manager.num_used_blocks == 0


# ---- the caps on the list fields (engine/engine_config.py's request limits), one check for every
# front: each refusal names the field, the cap and its flag, and holds nothing
@pytest.mark.parametrize("fields, named", [
    ({"stop": [f"s{i}" for i in range(65)]},
     "stop has 65 strings; the server allows at most 64 (--max-stop-strings)"),
    ({"stop_token_ids": [5] * 257},
     "stop_token_ids has 257 ids; the server allows at most 256 (--max-stop-token-ids)"),
    ({"bad_words": ["cat"] * 1025},
     "bad_words has 1025 words; the server allows at most 1024 (--max-bad-words)"),
    ({"logit_bias": {i: 1.0 for i in range(1025)}},
     "logit_bias has 1025 entries; the server allows at most 1024 (--max-logit-bias)"),
    ({"allowed_token_ids": [5] * 385},  # the default cap: the vocabulary (384)
     "allowed_token_ids has 385 ids; the server allows at most 384 (--max-allowed-token-ids)"),
    ({"stop": ["ok", "x" * 1025]},
     "stop[1] has 1025 characters; the server allows at most 1024 (--max-word-chars)"),
    ({"bad_words": ["cat", "y" * 1025]},
     "bad_words[1] has 1025 characters; the server allows at most 1024 (--max-word-chars)"),
    ({"bad_words": ["z" * 1000] * 66},
     ("bad_words has 66000 characters in all; the server allows at most 65536 "
      "(--max-bad-words-chars)")),
    ({"logprobs": -1},
     ("logprobs=-1 asks for all 384 tokens of the vocabulary; the server allows at most 5 "
      "(--max-logprobs")),
    ({"prompt_logprobs": -1}, "prompt_logprobs=-1 asks for all 384 tokens"),
])
def test_the_caps_name_field_cap_and_flag(engine: LLMEngine, fields: dict, named: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request([5, 6, 7], SamplingParams(**fields))
    assert named in str(info.value)
    assert not engine.requests and engine.block_manager.num_used_blocks == 0


def test_the_caps_are_flags(tiny_llama: Path) -> None:
    """Lower caps through EngineConfig's fields; at the cap itself a request runs."""
    small = LLMEngine(model=tiny_llama, dtype="float32", max_model_len=64, max_stop_strings=2,
                      max_bad_words=2, max_logit_bias=2, max_allowed_token_ids=3,
                      max_stop_token_ids=2, max_word_chars=4, max_bad_words_chars=6)
    ok = SamplingParams(max_new_tokens=2, stop=["ab", "abcd"], stop_token_ids=[5, 6],
                        bad_words=["cat", "dog"], logit_bias={5: 1.0, 6: 1.0},
                        allowed_token_ids=[40, 41, 42])
    assert len(small.generate([[5, 6, 7]], ok)[0].token_ids) <= 2
    for fields, flag in [({"stop": ["a", "b", "c"]}, "--max-stop-strings"),
                         ({"bad_words": ["x", "y", "z"]}, "--max-bad-words"),
                         ({"logit_bias": {1: 1.0, 2: 1.0, 3: 1.0}}, "--max-logit-bias"),
                         ({"allowed_token_ids": [1, 2, 3, 4]}, "--max-allowed-token-ids"),
                         ({"stop_token_ids": [1, 2, 3]}, "--max-stop-token-ids"),
                         ({"bad_words": ["horse"]}, "--max-word-chars"),
                         ({"bad_words": ["cat", "dogs"]}, "--max-bad-words-chars")]:
        with pytest.raises(InvalidRequestError, match=flag):
            small.add_request([5, 6], SamplingParams(**fields))


@pytest.mark.parametrize("field, value", [("max_stop_strings", 0), ("max_bad_words", -1),
                                          ("max_allowed_token_ids", 0), ("max_logprobs", -2)])
def test_the_caps_are_validated(field: str, value: int) -> None:
    from loraplex.engine.engine_config import EngineConfig

    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_logprobs_minus_one_is_the_whole_vocabulary(tiny_llama: Path) -> None:
    """vLLM's meaning: -1 asks for every token, allowed where --max-logprobs is -1 (no cap)
    or at least the vocabulary; the top list then holds all 384 tokens, best first."""
    for cap in (-1, 384, 1000):
        engine = LLMEngine(model=tiny_llama, dtype="float32", max_model_len=64, max_logprobs=cap)
        out = engine.generate([[5, 6, 7]], SamplingParams(
            temperature=0.0, max_new_tokens=2, logprobs=-1, prompt_logprobs=-1))[0]
        for lp in [*out.logprobs, *out.prompt_logprobs[1:]]:
            assert len(lp.top) == 384
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True)
    uncapped = LLMEngine(model=tiny_llama, dtype="float32", max_model_len=64, max_logprobs=-1)
    with pytest.raises(InvalidRequestError, match=r"--max-logprobs=-1 \(the vocabulary, 384\)"):
        uncapped.add_request([5], SamplingParams(logprobs=385))
