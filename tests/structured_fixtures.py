"""Builders shared by the structured-output tests and benches: the checks' JSON schemas with a
valid instance of each, a regex, a choice and a small grammar with a valid answer, and a
tiny byte-level BPE tokenizer (every byte spells, so JSON can be written with it; the word
tokenizer of the test models cannot write ``{``).

Every schema closes its objects (``additionalProperties: false``) and bounds its strings
and arrays, so that the grammar itself ends the answer: a tiny random model never chooses
to close a free string. Strings are ASCII patterns: xgrammar 0.2.9 takes an overlong UTF-8
sequence (``E0 88 B3``) as a character, which a random byte-level model writes and which
no strict decoder reads (a model trained on text does not write them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

NAME = {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"}

# (name, schema, a valid instance): nested objects, arrays with bounds, enums, patterns,
# number ranges, optional fields
SCHEMAS: list[tuple[str, dict[str, Any], Any]] = [
    ("flat", {
        "type": "object", "additionalProperties": False,
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"],
    }, {"name": "Ada", "age": 36}),
    ("nested", {
        "type": "object", "additionalProperties": False,
        "properties": {
            "user": {"type": "object", "additionalProperties": False,
                     "properties": {"name": NAME, "address": {
                         "type": "object", "additionalProperties": False,
                         "properties": {"city": NAME,
                                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                         "required": ["city", "zip"]}},
                     "required": ["name", "address"]},
        },
        "required": ["user"],
    }, {"user": {"name": "Bo", "address": {"city": "Paris", "zip": "75001"}}}),
    ("array_bounds", {
        "type": "object", "additionalProperties": False,
        "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
                       "scores": {"type": "array", "minItems": 2, "maxItems": 2,
                                  "items": {"type": "integer", "minimum": -9, "maximum": 9}}},
        "required": ["tags", "scores"],
    }, {"tags": ["a", "bc"], "scores": [3, -4]}),
    ("enum", {
        "type": "object", "additionalProperties": False,
        "properties": {"status": {"enum": ["active", "inactive", "banned"]},
                       "level": {"enum": [1, 2, 3]}},
        "required": ["status", "level"],
    }, {"status": "inactive", "level": 2}),
    ("pattern", {
        "type": "object", "additionalProperties": False,
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                       "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"}},
        "required": ["code", "email"],
    }, {"code": "SQL-42", "email": "ann@mail.com"}),
    ("ranges", {
        "type": "object", "additionalProperties": False,
        "properties": {"count": {"type": "integer", "minimum": 1, "maximum": 10},
                       "temp": {"type": "integer", "exclusiveMinimum": -40,
                                "exclusiveMaximum": 60},
                       "ok": {"type": "boolean"}},
        "required": ["count", "temp", "ok"],
    }, {"count": 7, "temp": -3, "ok": True}),
    ("optional", {
        "type": "object", "additionalProperties": False,
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                       "nickname": NAME,
                       "note": {"type": ["string", "null"], "pattern": "^[a-z0-9]{0,6}$"}},
        "required": ["id"],
    }, {"id": 12, "note": None}),
    ("array_of_objects", {
        "type": "array", "minItems": 1, "maxItems": 2,
        "items": {"type": "object", "additionalProperties": False,
                  "properties": {"sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"},
                                 "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                  "required": ["sku", "qty"]},
    }, [{"sku": "ab1", "qty": 3}, {"sku": "zz9", "qty": 10}]),
]

REGEX = r"[0-9]{3}-[0-9]{4}"
REGEX_ANSWER = "555-0199"
CHOICES = ["yes", "no", "maybe"]
# Lark, llguidance's grammar syntax: a sum of one- or two-digit numbers
GRAMMAR = 'start: expr\nexpr: NUM ("+" NUM){0,3}\nNUM: /[0-9]{1,2}/\n'
GRAMMAR_REGEX = r"[0-9]{1,2}(\+[0-9]{1,2}){0,3}"  # the same language (to check answers)
GRAMMAR_ANSWER = "12+7+30"
# xgrammar's EBNF of the same language (the library benchmark compares both)
GRAMMAR_EBNF = 'root ::= num ("+" num)? ("+" num)? ("+" num)?\nnum ::= [0-9] [0-9]?\n'


def compact(value: Any) -> str:
    """The compact JSON text of ``value`` (the default whitespace allows it)."""
    return json.dumps(value, separators=(",", ":"))


def distinct_schemas(n: int) -> list[dict[str, Any]]:
    """``n`` schemas that differ (as cache keys) and each compile: an object whose one
    integer field is named and bounded by its index."""
    return [{"type": "object", "additionalProperties": False,
             "properties": {f"f{i}": {"type": "integer", "minimum": 0, "maximum": i + 1}},
             "required": [f"f{i}"]} for i in range(n)]


def slow_schema(tag: int, props: int = 4, k: int = 120, pad: int = 0) -> dict[str, Any]:
    """A schema that is slow to compile: each property's pattern nests two bounded
    repetitions (k × k), which xgrammar 0.2.9's JSON path compiles in time superlinear in
    their product (~1.5 s a property at k = 120 on the byte tokenizer below, ~15 s at k = 20
    on SmolLM2's). The engine's max_pattern_repetition limit refuses it; tests of the
    compiler's bounds raise that limit. ``tag`` makes it a distinct cache key; ``pad`` bytes
    of description make its source large without making it slower."""
    properties = {f"p{tag}_{i}": {"type": "string",
                                  "pattern": f"^([{chr(97 + i % 26)}-z]{{1,{k}}}){{1,{k}}}$"}
                  for i in range(props)}
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False, "description": "x" * pad}


_CORPUS = [compact(v) for _, _, v in SCHEMAS] + [
    json.dumps(v) for _, _, v in SCHEMAS] + [
    "the cat sat on the mat. the answer is yes, no or maybe; 555-0199 and 12+7+30.",
    '{"name": "Paris", "country": "France", "count": 3, "ok": true, "note": null}',
]


def make_byte_tokenizer(out_dir: Path, vocab_size: int = 384) -> Path:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens (four specials, 256 bytes, merges
    learnt from JSON-like text), saved as HF files with a chat template, for tiny models
    with ``vocab_size`` rows."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return out_dir
