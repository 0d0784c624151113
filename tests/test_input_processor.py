"""The input processor (engine/input_processor.py): each request rule is checked once, there,
whatever the front (the Python API, HTTP's translation, the async engine's one hop); the
grammar is compiled only for a request that passed every other check; SamplingParams and
the checked request are frozen."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections import Counter
from pathlib import Path

import pytest
from loraplex import LLMEngine, SamplingParams
from loraplex.engine import input_processor as ip
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.input_processor import EngineRequest, RequestInput
from loraplex.errors import AdapterNotFoundError, InvalidRequestError
from loraplex.server.http.protocol import ChatCompletionRequest, CompletionRequest
from loraplex.server.http.request_convert import chat_input, completion_input

from tests.conftest import make_adapter

MAX_MODEL_LEN = 64
PROMPT = [5] * 30  # leaves 34 new tokens
SCHEMA = {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}
BAD_SCHEMA = {"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    adapter = make_adapter(tiny_llama, tmp_path_factory.mktemp("input_processor") / "a")
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_num_seqs=4,
                       max_model_len=MAX_MODEL_LEN, lora_modules={"a": str(adapter)})
    yield engine
    engine.input_processor.shutdown()
    engine.constraints.shutdown()


@pytest.fixture()
def compiles(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every grammar compile the engine is asked for (none runs: each gives no grammar)."""
    asked: list[str] = []

    def compile_(params: SamplingParams) -> None:
        asked.append("compile")

    async def compile_async(params: SamplingParams) -> None:
        asked.append("compile_async")

    monkeypatch.setattr(engine.constraints, "compile", compile_)
    monkeypatch.setattr(engine.constraints, "compile_async", compile_async)
    return asked


def process(engine: LLMEngine, prompt: list[int] | str, **kwargs) -> EngineRequest:
    adapter = kwargs.pop("adapter", None)
    field = kwargs.pop("max_tokens_field", None)
    return engine.input_processor.process(
        RequestInput(prompt, SamplingParams(**kwargs), adapter, max_tokens_field=field))


# ---- each rule, once, at the input processor -------------------------------------------
def test_unknown_adapter_is_not_found_and_costs_no_compile(engine, compiles):
    with pytest.raises(AdapterNotFoundError, match="unknown adapter 'nope'"):
        process(engine, PROMPT, max_new_tokens=2, structured_outputs=SCHEMA, adapter="nope")
    with pytest.raises(AdapterNotFoundError, match="unknown adapter 'nope'"):
        engine.make_sequence(PROMPT, SamplingParams(max_new_tokens=2,
                                                    structured_outputs=SCHEMA), "nope")
    assert compiles == []
    request = process(engine, PROMPT, max_new_tokens=2, adapter="a")
    assert request.adapter_name == "a" and request.adapter_id == engine.lora.lookup("a")
    base = process(engine, PROMPT, max_new_tokens=2, adapter=engine.model_name)
    assert (base.adapter_name, base.adapter_id) == (None, 0)


def test_an_unknown_adapter_comes_back_unbound_for_a_resolver(engine):
    inp = RequestInput(PROMPT, SamplingParams(max_new_tokens=2), "later", may_resolve=True)
    request = engine.input_processor.process(inp)
    assert (request.adapter_name, request.adapter_id) == ("later", None)
    with pytest.raises(AdapterNotFoundError, match="unknown adapter 'later'"):
        engine.input_processor.bind(request)  # the resolver did not load it


def test_max_tokens_over_the_context(engine):
    with pytest.raises(InvalidRequestError, match="max_new_tokens=35 does not fit: the prompt "
                                                  "has 30 tokens .* at most 34 new tokens"):
        process(engine, PROMPT, max_new_tokens=35)
    # a front's own name for it, in vLLM's words (HTTP's max_tokens)
    with pytest.raises(InvalidRequestError, match=r"max_tokens=35 is too large: this model's "
                       r"maximum context length is 64 tokens and the request has 30 input "
                       r"tokens \(35 > 64 - 30\)"):
        process(engine, PROMPT, max_new_tokens=35, max_tokens_field="max_tokens")
    assert process(engine, PROMPT, max_new_tokens=34).max_tokens == MAX_MODEL_LEN
    assert process(engine, PROMPT).params.max_new_tokens == 34  # unset: the room left


def test_http_max_tokens_is_checked_at_the_input_processor_only(engine):
    """HTTP's translation of a body checks no max_tokens against the context: the input
    processor does, with the field's name."""
    body = CompletionRequest.model_validate({"prompt": PROMPT, "max_tokens": 40})
    inp, _ = completion_input(body, engine.tokenizer, "cmpl-1")
    assert inp.max_tokens_field == "max_tokens" and inp.params.max_new_tokens == 40
    with pytest.raises(InvalidRequestError, match="max_tokens=40 is too large"):
        engine.input_processor.process(inp)
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "the cat"}],
         "max_completion_tokens": 1000})
    inp, _ = chat_input(chat, engine.tokenizer, "chatcmpl-1")
    with pytest.raises(InvalidRequestError, match="max_completion_tokens=1000 is too large"):
        engine.input_processor.process(inp)


def test_logit_bias_keys(engine):
    vocab = engine.base.hf_config.vocab_size
    # their form: once, where the params are built (every front builds them)
    with pytest.raises(ValueError, match="logit_bias key 'cat' is not a token id"):
        SamplingParams(logit_bias={"cat": 1.0})
    # their range against the vocabulary: once, at the input processor
    with pytest.raises(InvalidRequestError, match=f"logit_bias holds token id {vocab}"):
        process(engine, PROMPT, max_new_tokens=2, logit_bias={str(vocab): 1.0})
    assert process(engine, PROMPT, max_new_tokens=2,
                   logit_bias={"7": 2.0}).params.logit_bias == {7: 2.0}
    # HTTP's translation passes the keys on; the input processor refuses the id
    body = CompletionRequest.model_validate({"prompt": PROMPT, "max_tokens": 2,
                                             "logit_bias": {str(vocab): 5}})
    inp, _ = completion_input(body, engine.tokenizer, "cmpl-2")
    with pytest.raises(InvalidRequestError, match=f"logit_bias holds token id {vocab}"):
        engine.input_processor.process(inp)


def test_each_check_runs_once(engine, monkeypatch):
    calls: Counter[str] = Counter()
    seen_vocab: list[str] = []

    def counted(name: str, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            if name == "check_vocab":
                seen_vocab.append(args[1])
            return fn(*args, **kwargs)
        return wrapper

    for name in ("check_limits", "check_sampling", "check_vocab", "tokenize_bad_words"):
        monkeypatch.setattr(ip, name, counted(name, getattr(ip, name)))
    monkeypatch.setattr(SamplingParams, "validate",
                        counted("validate", SamplingParams.validate))
    monkeypatch.setattr(engine.input_processor, "tokenize",
                        counted("tokenize", engine.input_processor.tokenize))
    monkeypatch.setattr(engine.constraints, "check",
                        counted("constraints", engine.constraints.check))
    monkeypatch.setattr(engine.lora, "lookup", counted("lookup", engine.lora.lookup))
    seq = engine.make_sequence("the cat sat", SamplingParams(
        max_new_tokens=4, stop_token_ids=[3], bad_words=["dog"], logit_bias={"7": 1.0}), "a")
    assert dict(calls) == {"check_limits": 1, "validate": 1, "tokenize": 1, "check_vocab": 2,
                           "check_sampling": 1, "tokenize_bad_words": 1, "constraints": 1,
                           "lookup": 1}
    assert seen_vocab == ["the prompt", "stop_token_ids"]  # each list once
    assert seq.adapter_name == "a" and seq.max_tokens == len(seq.prompt_token_ids) + 4


# ---- the grammar, last ------------------------------------------------------------------
@pytest.mark.parametrize("wrong, fragment", [
    ({"max_new_tokens": 35}, "max_new_tokens=35 does not fit"),
    ({"temperature": -1.0}, "temperature=-1.0"),
    ({"max_new_tokens": 2, "logit_bias": {"999999": 1.0}}, "logit_bias holds token id"),
    ({"max_new_tokens": 2, "stop": ["x"] * 1000}, "(--max-stop-strings)"),
    ({"max_new_tokens": 2, "ignore_eos": True}, "ignore_eos cannot be combined"),
])
def test_a_schema_does_not_compile_when_another_field_is_wrong(engine, compiles, wrong,
                                                                fragment):
    # a schema no compile takes: were it compiled first, its error would come first
    params = SamplingParams(structured_outputs=BAD_SCHEMA, **wrong)
    with pytest.raises(InvalidRequestError, match=fragment.replace("(", r"\(")
                       .replace(")", r"\)")):
        engine.make_sequence(PROMPT, params)
    assert compiles == []


def test_the_bad_schema_fails_its_own_compile(engine):
    """The control: alone, BAD_SCHEMA's compile (the real one) refuses it."""
    with pytest.raises(InvalidRequestError, match="does not compile"):
        engine.make_sequence(PROMPT, SamplingParams(max_new_tokens=2,
                                                    structured_outputs=BAD_SCHEMA))


def test_a_request_that_passed_every_check_compiles_once(engine, compiles):
    params = SamplingParams(max_new_tokens=2, structured_outputs=SCHEMA)
    request = process(engine, PROMPT, max_new_tokens=2, structured_outputs=SCHEMA)
    assert compiles == []  # process compiles nothing
    engine.input_processor.compile(request)
    assert compiles == ["compile"]
    engine.make_sequence(PROMPT, params)
    assert compiles == ["compile"] * 2


def test_the_async_engine_checks_in_one_hop_and_compiles_last(engine, compiles):
    """A front's translation and every check run in one call on the processor's thread;
    a request refused there costs no compile; the compile is the caller's next step."""
    threads: list[str] = []

    def translate(**kwargs) -> RequestInput:
        threads.append(threading.current_thread().name)
        adapter = kwargs.pop("adapter", None)
        return RequestInput(PROMPT, SamplingParams(structured_outputs=SCHEMA, **kwargs),
                            adapter)

    async def main() -> None:
        aengine = AsyncEngine(engine)  # not started: nothing here reaches the engine thread
        with pytest.raises(InvalidRequestError, match="does not fit"):
            await aengine.process(lambda: translate(max_new_tokens=35))
        with pytest.raises(AdapterNotFoundError):
            await aengine.process(lambda: translate(max_new_tokens=2, adapter="nope"))
        with pytest.raises(AdapterNotFoundError):
            async for _ in aengine.generate(PROMPT, SamplingParams(
                    max_new_tokens=2, structured_outputs=SCHEMA), adapter="nope"):
                pass
        assert compiles == []
        request = await aengine.process(lambda: translate(max_new_tokens=2))
        assert compiles == [] and request.request_id.startswith("req-")
        await aengine.processor.compile_async(request)
        assert compiles == ["compile_async"]

    asyncio.run(main())
    assert set(threads) == {ip.THREAD_NAME + "_0"} and len(threads) == 3


# ---- frozen -------------------------------------------------------------------------------
def test_sampling_params_and_the_checked_request_are_frozen(engine):
    params = SamplingParams(stop="x", logit_bias={"7": 1.0})
    assert params.stop == ["x"] and params.logit_bias == {7: 1.0}  # normalized when built
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.n = 3  # type: ignore[misc]
    request = engine.input_processor.process(RequestInput(PROMPT, params))
    # the caller's params are untouched: the processor's are a copy with the defaults in
    assert params.max_new_tokens is None and params.temperature is None
    assert request.params.max_new_tokens == 34 and request.params.temperature is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.params.max_new_tokens = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.adapter_id = 3  # type: ignore[misc]
    assert dataclasses.replace(params, n=3).n == 3 and params.n == 1
