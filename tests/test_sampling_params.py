"""SamplingParams' sampling fields: validate() names the field and its range; the engine's
own checks (max_logprobs, max_num_seqs, the vocabulary) raise InvalidRequestError."""

from __future__ import annotations

from pathlib import Path

import pytest
from loraplex import LLMEngine, SamplingParams
from loraplex.engine.errors import InvalidRequestError


@pytest.mark.parametrize("fields, named", [
    ({"n": 0}, "n=0"),
    ({"logprobs": -1}, "logprobs=-1"),
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
