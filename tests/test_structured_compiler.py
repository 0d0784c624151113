"""structured/ without the engine: the constraint's checks, the compiler (errors named, the
LRU cache, the time limit), the matcher (EOS only where the grammar accepts, fork, rebuild
from tokens) and the step bitmask against a per-token oracle."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest
import torch
from loraplex.structured.bitmask import StepBitmask
from loraplex.structured.compiler import CacheStats, GrammarCompiler
from loraplex.structured.constraint import StructuredOutputs
from loraplex.structured.matcher import ConstraintMatcher
from transformers import AutoTokenizer

from tests import structured_fixtures as cases

EOS = 2
VOCAB = 384


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return AutoTokenizer.from_pretrained(
        cases.make_byte_tokenizer(tmp_path_factory.mktemp("byte_tok")))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, {EOS})


def allowed(matcher: ConstraintMatcher) -> set[int]:
    mask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    matcher.fill(mask, 0)
    bits = (mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.view(-1)[:VOCAB].nonzero().view(-1).tolist())


def walk(compiler: GrammarCompiler, tokenizer, c: StructuredOutputs, text: str
         ) -> ConstraintMatcher:
    """Walk ``text``'s tokens: each one allowed by the mask before it; EOS only at the end."""
    m = ConstraintMatcher(compiler.compile(c))
    for token in tokenizer(text, add_special_tokens=False).input_ids:
        ok = allowed(m)
        assert token in ok and EOS not in ok or m.complete
        assert m.accept(token)
    assert EOS in allowed(m) and m.complete
    return m


@pytest.mark.parametrize(("name", "schema", "value"), cases.SCHEMAS,
                         ids=[n for n, _, _ in cases.SCHEMAS])
def test_valid_answers_walk_every_schema(compiler, tokenizer, name, schema, value):
    """Compact JSON under the default; json.dumps's ", " / ": " once a request allows
    whitespace (the default was 4 until compact JSON became the default, issue 42)."""
    jsonschema.validate(value, schema)  # the case itself is right
    for text, ws in ((cases.compact(value), 0), (json.dumps(value), 4)):
        m = walk(compiler, tokenizer, StructuredOutputs(json=schema, max_whitespace=ws), text)
        assert m.accept(EOS) and m.finished
    m = walk(compiler, tokenizer, StructuredOutputs(json=schema), cases.compact(value))
    assert m.accept(EOS) and m.finished


def test_regex_choice_grammar_and_json_object(compiler, tokenizer):
    walk(compiler, tokenizer, StructuredOutputs(regex=cases.REGEX), cases.REGEX_ANSWER)
    walk(compiler, tokenizer, StructuredOutputs(choice=cases.CHOICES), "maybe")
    walk(compiler, tokenizer, StructuredOutputs(grammar=cases.GRAMMAR), cases.GRAMMAR_ANSWER)
    walk(compiler, tokenizer, StructuredOutputs(grammar=cases.GRAMMAR_EBNF), "3+45")
    walk(compiler, tokenizer, StructuredOutputs(json_object=True), '{"a":[1,{"b":null}]}')
    m = ConstraintMatcher(compiler.compile(StructuredOutputs(choice=["no", "nothing"])))
    assert m.accept(tokenizer("no", add_special_tokens=False).input_ids[0])
    assert m.complete and EOS in allowed(m)  # "no" may end, or go on to "nothing"
    assert len(allowed(m)) > 1


def test_json_is_compact_by_default(compiler, tokenizer):
    """Issue 42: the default allows no whitespace between JSON tokens (it allowed 4 per gap
    before, which a weak adapter spent as "sku"\n\n:\n\n); a request asks for more."""
    schema = cases.SCHEMAS[0][1]
    spaced = '{"name":      "Ada","age":36}'  # six spaces in one gap
    one_space = '{"name": "Ada","age":36}'
    for c, text, ok in [(StructuredOutputs(json=schema), one_space, False),
                        (StructuredOutputs(json=schema, max_whitespace=0), one_space, False),
                        (StructuredOutputs(json_object=True), '{"a": 1}', False),
                        (StructuredOutputs(json=schema, max_whitespace=4), one_space, True),
                        (StructuredOutputs(json=schema, max_whitespace=4), spaced, False),
                        (StructuredOutputs(json=schema, max_whitespace=8), spaced, True),
                        (StructuredOutputs(json=schema, max_whitespace=None), spaced, True)]:
        m = ConstraintMatcher(compiler.compile(c))
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert all(m.accept(t) for t in ids) is ok, (c.max_whitespace, text)


def test_length_bounded_strings_refuse_control_characters(compiler, tokenizer):
    """xgrammar writes a maxLength string's characters as [^"\\\\\\r\\n]; the compiler
    rewrites it so that a raw control character (invalid in JSON) is refused."""
    m = ConstraintMatcher(compiler.compile(StructuredOutputs(
        json={"type": "string", "minLength": 1, "maxLength": 4})))
    assert m.accept(tokenizer('"', add_special_tokens=False).input_ids[0])
    control = tokenizer.convert_tokens_to_ids("Ę")  # byte-level BPE's name of byte 0x18
    assert control not in allowed(m) and not m.accept(control)
    for t in tokenizer('abcd"', add_special_tokens=False).input_ids:
        assert m.accept(t)
    assert m.complete


@pytest.mark.parametrize(("constraint", "message"), [
    (StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "strin"}}}),
     r"structured_outputs\.json: the JSON schema does not compile: .*strin"),
    (StructuredOutputs(json='{"type": "object"'), r"structured_outputs\.json is not valid JSON"),
    (StructuredOutputs(json=[1]), r"structured_outputs\.json must be a JSON schema object"),
    (StructuredOutputs(regex="a(b"),
     r"structured_outputs\.regex: the regex does not compile: .*parenthesis"),
    (StructuredOutputs(grammar="root ::= x"), r"structured_outputs\.grammar: .*\"x\""),
    (StructuredOutputs(grammar="start: foo"), r"structured_outputs\.grammar: .*foo"),
    (StructuredOutputs(choice=[]), r"structured_outputs\.choice is empty"),
    (StructuredOutputs(choice="yes"), r"structured_outputs\.choice must be a list"),
    (StructuredOutputs(choice=["a", 1]), r"structured_outputs\.choice holds 1"),
    (StructuredOutputs(regex=""), r"structured_outputs\.regex must be a non-empty string"),
    (StructuredOutputs(), r"exactly one of .*; it gives none"),
    (StructuredOutputs(regex="a", choice=["a"]), r"exactly one of .*; it gives regex, choice"),
    (StructuredOutputs(json_object=True, max_whitespace=-1), r"max_whitespace=-1"),
])
def test_bad_constraints_name_what_is_wrong(compiler, constraint, message):
    with pytest.raises(ValueError, match=message) as info:
        compiler.compile(constraint)
    assert "/project/" not in str(info.value)  # xgrammar's source paths are cut


def test_fifty_schemas_fill_and_hit_the_cache(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, {EOS}, capacity=50)
    schemas = cases.distinct_schemas(50)
    compiled = [compiler.compile(StructuredOutputs(json=s)) for s in schemas]
    assert compiler.stats() == CacheStats(hits=0, misses=50, size=50, capacity=50)
    # the same schemas again, as dicts and as text: every one a hit, the same grammar
    again = [compiler.compile(StructuredOutputs(json=json.dumps(s))) for s in schemas]
    assert all(a is b for a, b in zip(compiled, again))
    s = compiler.stats()
    assert (s.hits, s.misses, s.size) == (50, 50, 50)
    compiler.compile(StructuredOutputs(json=cases.distinct_schemas(51)[50]))  # evicts the LRU
    compiler.compile(StructuredOutputs(json=schemas[0]))
    assert compiler.stats().misses == 52
    # whitespace is part of the key
    compiler.compile(StructuredOutputs(json=schemas[1], max_whitespace=0))
    assert compiler.stats().misses == 53


def test_async_compile(tokenizer):
    """The time limit, the pending cap and the worker processes: test_structured_compile_
    bounds.py (a timed-out compile no longer goes on and lands in the cache: its worker is
    killed, issue 42)."""
    fast = GrammarCompiler(tokenizer, VOCAB, {EOS})
    grammar = asyncio.run(fast.compile_async(StructuredOutputs(regex=cases.REGEX)))
    assert grammar is fast.compile(StructuredOutputs(regex=cases.REGEX))
    with pytest.raises(ValueError, match="regex"):
        asyncio.run(fast.compile_async(StructuredOutputs(regex="(")))
    fast.shutdown()


def test_fork_and_rebuild_from_tokens(compiler, tokenizer):
    c = StructuredOutputs(json=cases.SCHEMAS[0][1])
    ids = tokenizer(cases.compact(cases.SCHEMAS[0][2]), add_special_tokens=False).input_ids
    m = ConstraintMatcher(compiler.compile(c))
    for t in ids[:4]:
        assert m.accept(t)
    fork = m.fork()
    for t in ids[4:]:
        assert m.accept(t)
    assert m.complete and not fork.complete and fork.num_tokens == 4
    assert allowed(fork) != allowed(m)
    for t in ids[4:]:
        assert fork.accept(t)
    assert fork.complete
    fresh = ConstraintMatcher(compiler.compile(c))  # as after preemption: rebuilt
    fresh.sync(ids[:5])
    again = ConstraintMatcher(compiler.compile(c))
    for t in ids[:5]:
        again.accept(t)
    assert allowed(fresh) == allowed(again) and fresh.num_tokens == 5
    fresh.sync(ids[:5])  # level already: nothing to do
    with pytest.raises(ValueError, match="breaks the grammar"):
        ConstraintMatcher(compiler.compile(c)).sync([EOS])


def test_step_bitmask_masks_constrained_rows_only(compiler, tokenizer):
    bitmask = StepBitmask(VOCAB, rows=2)
    m = ConstraintMatcher(compiler.compile(StructuredOutputs(choice=["yes", "no"])))
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    pending = bitmask.start([None, m, None])  # grows past 2 rows
    bitmask.apply(logits, pending)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    ok = sorted(allowed(m))
    assert torch.isfinite(logits[1]).nonzero().view(-1).tolist() == ok
    assert torch.equal(logits[1, ok], before[1, ok])
    assert bitmask.start([None, None]) is None
    bitmask.shutdown()


def test_choice_escapes(compiler, tokenizer):
    weird = ['say "hi"', "back\\slash", "new\nline"]
    for text in weird:
        walk(compiler, tokenizer, StructuredOutputs(choice=weird), text)


def test_byte_tokenizer_spells_json(tmp_path: Path):
    tok = AutoTokenizer.from_pretrained(cases.make_byte_tokenizer(tmp_path))
    assert len(tok) == VOCAB
    text = cases.compact(cases.SCHEMAS[1][2])
    assert tok.decode(tok(text).input_ids) == text
