"""Structured outputs through the engine: a tiny random model (junk on its own) answers every
schema validly, for the base and adapters in mixed batches, on the cpu and torch backends;
regex, choice and grammar; free requests in the same batches are exact; preemption keeps
the matchers right; bad constraints are refused naming what is wrong."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from loraplex import LLMEngine, SamplingParams
from loraplex.engine.async_engine import AsyncEngine
from loraplex.errors import InvalidRequestError
from loraplex.structured.constraint import StructuredOutputs

from tests import structured_fixtures as cases
from tests.conftest import make_adapter, make_tiny_model

PROMPTS = ["the cat sat on", "user: give json", "select name from", "one two three"]


@pytest.fixture(scope="module")
def json_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """A tiny random llama whose tokenizer can spell JSON (byte-level BPE), and two
    adapters."""
    root = tmp_path_factory.mktemp("json_model")
    model = make_tiny_model(root / "base", "llama", seed=3)
    for f in model.glob("*token*"):
        f.unlink()
    cases.make_byte_tokenizer(model)
    adapters = {name: make_adapter(model, root / name, seed=i, scale=0.3,
                                   target_modules=["q_proj", "v_proj", "down_proj"])
                for i, name in enumerate(["extract", "tools"])}
    return model, adapters


def engine_for(json_model, **kwargs) -> LLMEngine:
    model, adapters = json_model
    return LLMEngine(model=model, dtype="float32", max_num_seqs=32, max_model_len=512,
                     lora_modules={k: str(v) for k, v in adapters.items()}, **kwargs)


@pytest.fixture(scope="module")
def shared(json_model) -> Iterator[list[LLMEngine]]:
    """The module's one engine (a box: ``engine`` replaces it when a test left it unclean);
    its compiler's processes are stopped at the module's end."""
    box: list[LLMEngine] = []
    yield box
    for e in box:
        e.constraints.shutdown()


@pytest.fixture
def engine(json_model, shared: list[LLMEngine]) -> LLMEngine:
    """A clean engine (no request, no used block) shared by the tests that need no fresh
    one: an engine's compiler starts a zygote (an interpreter importing xgrammar and torch)
    and compiles from an empty cache, ~3.5 s of CPU each. A test that counts compiles from
    zero, builds under other kernels or settings, or stops the engine (an AsyncEngine's
    shutdown stops its compiler) builds its own. A test that failed and left requests or
    blocks behind hands the next a fresh engine."""
    if not shared or not _is_clean(shared[0]):
        for e in shared:
            e.constraints.shutdown()
        shared[:] = [engine_for(json_model)]
    return shared[0]


def constrained(c: dict, seed: int | None = None, max_new: int = 300) -> SamplingParams:
    return SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed,
                          max_new_tokens=max_new, structured_outputs=c)


def free(max_new: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)


def _is_clean(engine: LLMEngine) -> bool:
    return (engine.block_manager.num_used_blocks == 0
            and not engine.has_unfinished_requests() and not engine.requests)


def assert_clean(engine: LLMEngine) -> None:
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished_requests() and not engine.requests


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
def test_schemas_in_mixed_batches_with_free_requests(json_model, engine, kernels, monkeypatch):
    """Every schema, greedy and sampled, on the base and both adapters, in one batch with
    free requests, whose tokens equal what they are alone."""
    monkeypatch.setenv("LORAPLEX_KERNELS", kernels)
    if engine.base.kernels.name != kernels:  # the shared engine runs the default kernels
        engine = engine_for(json_model)
    assert engine.base.kernels.name == kernels
    adapters = [None, "extract", "tools"]
    jobs = []  # (prompt, params, adapter, schema or None)
    for i, (_, schema, _) in enumerate(cases.SCHEMAS):
        for j, seed in enumerate([None, 7 + i]):
            jobs.append((PROMPTS[i % 4], constrained({"json": schema}, seed),
                         adapters[(i + j) % 3], schema))
    for i, adapter in enumerate(adapters):
        jobs.append((PROMPTS[i], free(), adapter, None))
    outs = engine.generate([j[0] for j in jobs], [j[1] for j in jobs], [j[2] for j in jobs])
    for (_, _, adapter, schema), out in zip(jobs, outs):
        if schema is not None:
            assert out.finish_reason == "eos", (adapter, out.text)
            jsonschema.validate(json.loads(out.text), schema)
    alone = engine.generate([j[0] for j in jobs if j[3] is None],
                            [free() for j in jobs if j[3] is None],
                            [j[2] for j in jobs if j[3] is None])
    assert [o.token_ids for o in alone] == [o.token_ids for o, j in zip(outs, jobs)
                                            if j[3] is None]
    assert_clean(engine)


def test_regex_choice_grammar_and_json_object(engine):
    jobs = [({"regex": cases.REGEX}, lambda t: re.fullmatch(cases.REGEX, t)),
            ({"choice": cases.CHOICES}, lambda t: t in cases.CHOICES),
            ({"grammar": cases.GRAMMAR}, lambda t: re.fullmatch(cases.GRAMMAR_REGEX, t)),
            ({"grammar": cases.GRAMMAR_EBNF}, lambda t: re.fullmatch(cases.GRAMMAR_REGEX, t))]
    params, checks, adapters = [], [], []
    for k, (c, check) in enumerate(jobs):
        for i, seed in enumerate([None, 1, 2]):
            params.append(constrained(c, seed, max_new=40))
            checks.append(check)
            adapters.append([None, "extract", "tools"][(i + k) % 3])
    outs = engine.generate([PROMPTS[i % 4] for i in range(len(params))], params, adapters)
    for out, check in zip(outs, checks):
        assert out.finish_reason == "eos" and check(out.text), out.text
    # any JSON object: the junk model may not close it in time, but never leaves JSON
    out = engine.generate(["the cat"], constrained({"json_object": True}, seed=5,
                                                   max_new=400))[0]
    if out.finish_reason == "eos":
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.finish_reason == "length" and out.text.lstrip().startswith("{")
    assert_clean(engine)


def test_max_tokens_first_gives_length(engine):
    schema = cases.SCHEMAS[1][1]
    out = engine.generate(["the cat"], constrained({"json": schema}, max_new=5))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith("{")
    assert_clean(engine)


def test_preemption_keeps_the_matchers_right(json_model, engine):
    """Few KV blocks: sequences are preempted and recomputed mid-answer; greedy answers
    equal those of a roomy engine (the shared one), and validate."""
    jobs = [(PROMPTS[i % 4] + " and" * i, cases.SCHEMAS[i % len(cases.SCHEMAS)][1])
            for i in range(12)]
    params = [constrained({"json": s}) for _, s in jobs]
    roomy = engine.generate([p for p, _ in jobs], params)
    tight = engine_for(json_model, num_kv_blocks=14, block_size=16)
    seqs = [tight.make_sequence(p, constrained({"json": s})) for p, s in jobs]
    for seq in seqs:
        tight.add_sequence(seq)
    done = {}
    while len(done) < len(seqs):
        done.update({o.request_id: o for o in tight.step() if o.finished})
    assert sum(s.num_preemptions for s in seqs) > 0, "nothing was preempted"
    assert [done[s.request_id].token_ids for s in seqs] == [o.token_ids for o in roomy]
    for (_, schema), seq in zip(jobs, seqs):
        jsonschema.validate(json.loads(done[seq.request_id].text), schema)
    assert_clean(tight)


def test_a_copied_sequence_gets_its_own_matcher(engine):
    """A sequence copied with its parent's matcher (as an n > 1 fork is) gets a matcher of
    its own at its first step; both answer validly, sampled from their own seeds."""
    schema = cases.SCHEMAS[2][1]
    parent = engine.make_sequence("the cat", constrained({"json": schema}, seed=1))
    child = dataclasses.replace(parent, request_id="child", output_token_ids=[], block_table=[],
                                params=dataclasses.replace(parent.params, seed=2))
    assert child.matcher is parent.matcher
    for seq in (parent, child):
        engine.add_sequence(seq)
    done = {}
    while len(done) < 2:
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert child.matcher is not parent.matcher or child.is_finished
    for out in done.values():
        assert out.finish_reason == "eos"
        jsonschema.validate(json.loads(out.text), schema)
    assert done["child"].token_ids != done[parent.request_id].token_ids
    assert_clean(engine)


def test_n_choices_each_hold_their_own_matcher(engine):
    """n > 1 forks from one prefill: every choice answers the schema from its own seed, in a
    batch with a free request and an adapter."""
    schema = cases.SCHEMAS[0][1]
    params = SamplingParams(temperature=1.0, seed=11, n=4, max_new_tokens=300,
                            structured_outputs={"json": schema})
    outs = engine.generate(["the cat", "one two"], [params, free()], [None, "extract"])
    choices = outs[0]
    assert [c.index for c in choices] == [0, 1, 2, 3]
    for c in choices:
        assert c.finish_reason == "eos", c.text
        jsonschema.validate(json.loads(c.text), schema)
    assert len({tuple(c.token_ids) for c in choices}) > 1
    assert outs[1].token_ids == engine.generate(["one two"], free(), ["extract"])[0].token_ids
    assert_clean(engine)


@pytest.mark.parametrize(("c", "message"), [
    ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}},
     r"structured_outputs\.json: the JSON schema does not compile: .*strin"),
    ({"regex": "[0-9"}, r"structured_outputs\.regex: the regex does not compile"),
    ({"choice": []}, r"structured_outputs\.choice is empty"),
    ({"grammar": "root ::= nothing"}, r"structured_outputs\.grammar: .*nothing"),
    ({"regex": "a", "choice": ["a"]}, r"exactly one of"),
    ({"jsonschema": {}}, r"structured_outputs: .*jsonschema"),
])
def test_bad_constraints_are_refused_and_nothing_leaks(engine, c, message):
    with pytest.raises(ValueError, match=message):  # InvalidRequestError is a ValueError
        engine.add_request("the cat", SamplingParams(structured_outputs=c))
    with pytest.raises(InvalidRequestError, match="ignore_eos cannot be combined"):
        engine.add_request("the cat", SamplingParams(ignore_eos=True,
                                                     structured_outputs={"choice": ["a"]}))
    with pytest.raises(InvalidRequestError, match="min_new_tokens cannot be combined"):
        engine.add_request("the cat", SamplingParams(min_new_tokens=2,
                                                     structured_outputs={"choice": ["a"]}))
    out = engine.generate(["the cat"], constrained({"choice": ["yes", "no"]}))[0]
    assert out.text in ("yes", "no")
    assert_clean(engine)


def test_async_engine_compiles_off_the_engine_thread(json_model):
    engine = engine_for(json_model)

    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            params = constrained({"json": cases.SCHEMAS[3][1]})
            text = ""
            async for out in ae.generate("the cat", params):
                text += out.new_text
            jsonschema.validate(json.loads(text), cases.SCHEMAS[3][1])
            with pytest.raises(InvalidRequestError, match="regex"):
                async for _ in ae.generate("the cat", constrained({"regex": "(("})):
                    pass
            stats = engine.constraints.compiler.stats()
            assert stats.misses == 2
        finally:
            ae.shutdown()

    asyncio.run(main())


def test_structured_outputs_object_and_dict_are_one(engine):
    """The object form finds the dict form's compiled grammar (one key): a cache hit."""
    a = engine.generate(["one two"], constrained({"regex": cases.REGEX}))[0]
    hits = engine.constraints.compiler.stats().hits  # the shared engine's so far
    b = engine.generate(["one two"], SamplingParams(
        temperature=0.0, max_new_tokens=300,
        structured_outputs=StructuredOutputs(regex=cases.REGEX)))[0]
    assert a.token_ids == b.token_ids
    assert engine.constraints.compiler.stats().hits == hits + 1


def test_every_other_check_runs_before_a_compile(json_model):
    """Issue 42: a request that fails any other check never costs a compile (the grammar is
    requested last), on the offline path and through the AsyncEngine; the size limits are
    checks of their own, before any compile."""
    engine = engine_for(json_model)
    schema = {"json": cases.SCHEMAS[1][1]}  # never compiled in this engine
    deep: dict = {"type": "integer"}
    for _ in range(70):
        deep = {"type": "array", "items": deep}
    bad = [({"max_new_tokens": 10_000}, None, "max_new_tokens=10000 does not fit"),
           ({"temperature": -1.0}, None, "temperature"),
           ({"ignore_eos": True}, None, "ignore_eos cannot be combined"),
           ({}, "no-such-adapter", "no-such-adapter"),
           ({"structured_outputs": {"json": deep}}, None, "nests more than 64 levels")]
    for fields, adapter, message in bad:
        params = SamplingParams(**{"structured_outputs": schema, **fields})
        with pytest.raises(LookupError if adapter else InvalidRequestError, match=message):
            engine.add_request("the cat", params, adapter)

    async def through_async_engine() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            for fields, adapter, message in bad:
                params = SamplingParams(**{"structured_outputs": schema, **fields})
                with pytest.raises(LookupError if adapter else InvalidRequestError,
                                   match=message):
                    async for _ in ae.generate("the cat", params, adapter):
                        pass
        finally:
            ae.shutdown()

    asyncio.run(through_async_engine())
    assert engine.constraints.compiler.stats().misses == 0
    assert engine.constraints.compiler.worker_pids() == []  # no worker was ever needed
    assert_clean(engine)
