"""GrammarCompiler: StructuredOutputs → xgrammar CompiledGrammar, on worker threads, into an
LRU cache keyed by the constraint (``StructuredOutputs.key``).

A request waits for its own grammar (``compile`` blocks its caller, ``compile_async`` awaits
on its event loop); the engine step never compiles. Compiling has a time limit: past it the
request gets a ValueError, while the compile goes on on its worker and lands in the cache
(xgrammar cannot be interrupted), so a second request for the same constraint waits on
that compile rather than starting another. A constraint that does not compile is cached as
its error. Safe on any thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import xgrammar

from ..kernel_backends import intra_op
from .constraint import StructuredOutputs

DEFAULT_CAPACITY = 256  # compiled grammars kept
DEFAULT_TIMEOUT_S = 30.0
# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: " and may hold a failed
# check's condition: neither helps the user
_NOISE = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    size: int
    capacity: int


class GrammarCompiler:
    def __init__(self, tokenizer: object, vocab_size: int, stop_token_ids: Iterable[int],
                 capacity: int = DEFAULT_CAPACITY, timeout_s: float = DEFAULT_TIMEOUT_S,
                 workers: int = 2):
        """``tokenizer``: the model's HF tokenizer; ``vocab_size``: the logits' width (the
        model's, which may exceed the tokenizer's); ``stop_token_ids``: the tokens that end
        an answer where the grammar accepts (the engine's EOS ids)."""
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.capacity = capacity
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        self._hits = self._misses = 0
        self._compiler: xgrammar.GrammarCompiler | None = None  # built on first use (~0.4 s)
        self._compiler_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="loraplex-grammar", initializer=intra_op.serial_thread)

    # ---- any thread ---------------------------------------------------------------------
    def submit(self, constraint: StructuredOutputs) -> concurrent.futures.Future:
        """The future of ``constraint``'s CompiledGrammar (ValueError if it does not compile):
        the cached one, or a compile started now. ``constraint`` must be validated."""
        key = constraint.key()
        with self._lock:
            fut = self._entries.get(key)
            if fut is not None:
                self._hits += 1
                self._entries.move_to_end(key)
                return fut
            self._misses += 1
            fut = self._pool.submit(self._compile, constraint)
            self._entries[key] = fut
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
            return fut

    def compile(self, constraint: StructuredOutputs) -> xgrammar.CompiledGrammar:
        """Block until ``constraint`` is compiled; ValueError naming what is wrong, or the
        time limit."""
        constraint.validate()
        try:
            return self.submit(constraint).result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._timeout(constraint) from None

    async def compile_async(self, constraint: StructuredOutputs) -> xgrammar.CompiledGrammar:
        """``compile`` for an event loop: the loop runs on while the grammar compiles."""
        constraint.validate()
        fut = asyncio.wrap_future(self.submit(constraint))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except asyncio.TimeoutError:
            raise self._timeout(constraint) from None

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, len(self._entries), self.capacity)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _timeout(self, constraint: StructuredOutputs) -> ValueError:
        return ValueError(f"structured_outputs: compiling the {constraint.describe()} took "
                          f"longer than the time limit of {self.timeout_s:g} s")

    # ---- worker threads -----------------------------------------------------------------
    def _xgrammar(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids or None)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1,
                                                          cache_enabled=False)
            return self._compiler

    def _compile(self, c: StructuredOutputs) -> xgrammar.CompiledGrammar:
        compiler = self._xgrammar()
        kind = c.kind
        try:
            if kind in ("json", "json_object"):
                ws = c.max_whitespace
                return compiler.compile_json_schema(
                    _strict_strings(c.schema()), any_whitespace=ws != 0, separators=(",", ":") if ws == 0 else None,
                    max_whitespace_cnt=ws or None)
            if kind == "regex":
                return compiler.compile_regex(c.regex)
            if kind == "choice":
                ebnf = "root ::= " + " | ".join(_ebnf_literal(s) for s in c.choice)
                return compiler.compile_grammar(ebnf)
            if "::=" in c.grammar:
                return compiler.compile_grammar(c.grammar)
            return compiler.compile_lark(c.grammar)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"structured_outputs.{kind}: the {c.describe()} does not compile: "
                             f"{_clean(str(e))}") from None


def _strict_strings(node: Any) -> Any:
    """``node`` with every length-bounded string (minLength / maxLength, no pattern or
    format) given as the equivalent pattern. xgrammar 0.2.9 writes such a string's
    characters as ``[^"\\\r\n]``, which lets raw control characters (U+0000-U+001F) into
    the answer, and strict JSON parsers refuse them; its pattern path excludes them."""
    if isinstance(node, list):
        return [_strict_strings(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict_strings(v) for k, v in node.items()}
    types = out.get("type")
    is_string = types == "string" or (isinstance(types, list) and "string" in types)
    if is_string and ("minLength" in out or "maxLength" in out) and not (
            {"pattern", "format", "enum", "const"} & out.keys()):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{low},{high}}}$'
    return out


def _ebnf_literal(s: str) -> str:
    """``s`` as an EBNF string literal (JSON's escapes are EBNF's)."""
    return json.dumps(s, ensure_ascii=False)


def _clean(message: str) -> str:
    return _NOISE.sub("", message.strip()).strip()
