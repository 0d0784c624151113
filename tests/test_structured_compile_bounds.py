"""The grammar compiler's bounds (issue 42), without the engine: compiles run in worker
processes that are killed past the time limit (which counts running time, not the queue)
or when nobody waits any more; the pending cap refuses with CapacityError and caches
nothing; a small constraint passes a flood of slow ones on its own worker; a grammar
compiled in a worker and deserialized masks exactly as one compiled in this process; the
size limits refuse before any compile.

The slow schemas nest bounded repetitions in patterns, which xgrammar 0.2.9 compiles in
time superlinear in their product (the engine's limits refuse them; the compiler alone
compiles what it is given)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import xgrammar
from loraplex.errors import CapacityError
from loraplex.structured.compile_worker import compile_constraint
from loraplex.structured.compiler import GrammarCompiler
from loraplex.structured.constraint import StructuredOutputs
from loraplex.structured.limits import ConstraintLimits, nested_repetition
from loraplex.structured.matcher import ConstraintMatcher
from transformers import AutoTokenizer

from tests import structured_fixtures as cases
from tests.test_structured_compiler import EOS, VOCAB, allowed


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return AutoTokenizer.from_pretrained(
        cases.make_byte_tokenizer(tmp_path_factory.mktemp("byte_tok")))


def slow(tag: int, props: int = 4, k: int = 120, pad: int = 0) -> StructuredOutputs:
    """A schema that takes this tokenizer seconds to compile (cases.slow_schema)."""
    return StructuredOutputs(json=cases.slow_schema(tag, props, k, pad))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_time_limit_kills_the_worker_and_counts_running_time_only(tokenizer):
    """One general worker, nothing on the fast lane: a slow compile holds it until its limit
    kills it (its process ends, nothing is cached); a medium compile queued behind it for
    longer than the limit still compiles, since only its running time counts."""
    compiler = GrammarCompiler(tokenizer, VOCAB, {EOS}, timeout_s=3.0, workers=1,
                               fast_bytes=0)
    try:
        compiler.compile(StructuredOutputs(choice=["warm"]))  # workers up
        wait_for(lambda: len(compiler.worker_pids()) == 2)
        pids = set(compiler.worker_pids())

        async def both() -> tuple[BaseException | None, float]:
            hog = asyncio.create_task(compiler.compile_async(slow(0)))
            await asyncio.sleep(0.2)  # the hog runs first
            start = time.monotonic()
            await compiler.compile_async(slow(1, props=1, k=40))  # well under a second
            queued_for = time.monotonic() - start
            try:
                await hog
            except ValueError as e:
                return e, queued_for
            return None, queued_for

        error, waited = asyncio.run(both())
        assert error is not None and "took longer than the time limit of 3 s" in str(error)
        assert "--grammar-compile-timeout" in str(error)
        assert waited >= 2.5  # queued behind the hog for about its limit, and not refused
        killed = pids - set(compiler.worker_pids())
        assert killed and not any(alive(p) for p in killed)
        stats = compiler.stats()
        assert stats.pending == 0 and stats.size == 2  # "warm" and the medium one
        with pytest.raises(ValueError, match="time limit"):  # not cached: compiled again
            compiler.compile(slow(0))
        assert compiler.stats().misses == 4
    finally:
        compiler.shutdown()


def test_a_compile_nobody_waits_for_is_dropped_or_killed(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, {EOS}, timeout_s=60.0, workers=1,
                               fast_bytes=0)
    try:
        compiler.compile(StructuredOutputs(choice=["warm"]))
        wait_for(lambda: len(compiler.worker_pids()) == 2)  # the fast one and the general
        pids = set(compiler.worker_pids())

        async def main() -> None:
            running = asyncio.create_task(compiler.compile_async(slow(2)))
            await asyncio.sleep(0.3)
            queued = asyncio.create_task(compiler.compile_async(slow(3)))
            twice = asyncio.create_task(compiler.compile_async(slow(2)))  # the same compile
            await asyncio.sleep(0.3)
            assert compiler.stats().pending == 2
            queued.cancel()
            await asyncio.sleep(0.1)
            assert compiler.stats().pending == 1  # left the queue at once
            running.cancel()
            await asyncio.sleep(0.3)
            assert all(alive(p) for p in pids)  # another request waits for slow(2)
            assert compiler.stats().pending == 1
            twice.cancel()
            start = time.monotonic()
            while all(alive(p) for p in pids):
                assert time.monotonic() - start < 10, "the abandoned compile ran on"
                await asyncio.sleep(0.05)
            assert compiler.stats().pending == 0
            for task in (running, queued, twice):
                with pytest.raises(asyncio.CancelledError):
                    await task

        asyncio.run(main())
        wait_for(lambda: len(set(compiler.worker_pids()) - pids) == 1)  # replaced
        assert compiler.compile(StructuredOutputs(regex="[0-9]")) is not None
    finally:
        compiler.shutdown()


def test_pending_cap_refuses_with_capacity_error_and_caches_nothing(tokenizer):
    """max_pending 4: large constraints hold at most 2 places; a refused constraint
    compiles once there is room (a refusal is not cached as its answer)."""
    compiler = GrammarCompiler(tokenizer, VOCAB, {EOS}, timeout_s=60.0, workers=1,
                               max_pending=4, fast_bytes=2000)
    large = [slow(10 + i, pad=3000) for i in range(3)]
    small = [slow(20 + i) for i in range(2)]  # small sources: the fast lane
    cheap = StructuredOutputs(json={"type": "object", "properties": {
        "refused": {"type": "integer"}}}, max_whitespace=None)

    async def main() -> None:
        tasks = [asyncio.create_task(compiler.compile_async(c)) for c in large[:2]]
        await asyncio.sleep(0.1)
        with pytest.raises(CapacityError, match=r"busy: 2 large grammars .*half of "
                                                r"--max-pending-grammars 4"):
            await compiler.compile_async(large[2])
        tasks += [asyncio.create_task(compiler.compile_async(c)) for c in small]
        await asyncio.sleep(0.1)
        with pytest.raises(CapacityError, match=r"busy: 4 compiles pending, the most "
                                                r"--max-pending-grammars allows \(4\)"):
            await compiler.compile_async(cheap)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    try:
        asyncio.run(main())
        wait_for(lambda: compiler.stats().pending == 0)
        misses = compiler.stats().misses
        assert compiler.compile(cheap) is not None and compiler.stats().misses == misses + 1
        assert not isinstance(CapacityError("x"), ValueError)  # never a 400
    finally:
        compiler.shutdown()


def test_a_small_constraint_passes_a_flood_of_slow_ones(tokenizer):
    """workers + 2 slow large schemas and a slow small one in flight: a cheap choice and a
    small schema compile in about their own time on the fast lane's worker; the slow small
    one moved off the fast lane past its budget."""
    compiler = GrammarCompiler(tokenizer, VOCAB, {EOS}, timeout_s=4.0, workers=2,
                               fast_bytes=2000, fast_seconds=0.5)
    try:
        compiler.compile(StructuredOutputs(choice=["warm"]))
        wait_for(lambda: len(compiler.worker_pids()) == 3)

        async def main() -> float:
            flood = [asyncio.create_task(compiler.compile_async(slow(30 + i, pad=3000)))
                     for i in range(4)]
            flood.append(asyncio.create_task(compiler.compile_async(slow(40))))  # small
            await asyncio.sleep(0.8)  # the small slow one has left the fast lane by now
            start = time.monotonic()
            await compiler.compile_async(StructuredOutputs(choice=["yes", "no"]))
            await compiler.compile_async(StructuredOutputs(json=cases.SCHEMAS[1][1]))
            took = time.monotonic() - start
            results = await asyncio.gather(*flood, return_exceptions=True)
            for r in results:  # past the time limit, or (on an idle machine) too large
                assert isinstance(r, ValueError) and ("time limit" in str(r) or
                                                      "too large" in str(r)), r
            return took

        took = asyncio.run(main())
        assert took < 3.0, took  # the flood alone holds the general workers ~12 s
    finally:
        compiler.shutdown()


@pytest.mark.parametrize("c", [
    *(StructuredOutputs(json=s) for _, s, _ in cases.SCHEMAS),
    StructuredOutputs(json=cases.SCHEMAS[1][1], max_whitespace=4),
    StructuredOutputs(json_object=True), StructuredOutputs(regex=cases.REGEX),
    StructuredOutputs(choice=cases.CHOICES), StructuredOutputs(grammar=cases.GRAMMAR),
], ids=lambda c: c.kind)
def test_a_worker_compiled_grammar_masks_as_one_compiled_here(tokenizer, compiler_pair, c):
    ours, local = compiler_pair
    answers = {"json": None, "json_object": '{"a":[1,{"b":null}]}', "regex": cases.REGEX_ANSWER,
               "choice": "maybe", "grammar": cases.GRAMMAR_ANSWER}
    text = answers[c.kind]
    if text is None:
        value = next(v for _, s, v in cases.SCHEMAS if s == c.json)
        text = cases.compact(value)
    a = ConstraintMatcher(ours.compile(c))
    b = ConstraintMatcher(compile_constraint(local, c))
    for token in [*tokenizer(text, add_special_tokens=False).input_ids, EOS]:
        assert allowed(a) == allowed(b)
        assert a.accept(token) and b.accept(token)


@pytest.fixture(scope="module")
def compiler_pair(tokenizer):
    ours = GrammarCompiler(tokenizer, VOCAB, {EOS})
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB,
                                                   stop_token_ids=[EOS])
    yield ours, xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    ours.shutdown()


def test_too_large_a_grammar_is_refused_and_cached_as_its_error(tokenizer):
    """... and the worker that ran it is replaced: its heap may keep what it took."""
    compiler = GrammarCompiler(tokenizer, VOCAB, {EOS}, max_compiled_bytes=64 << 10)
    try:
        compiler.compile(StructuredOutputs(choice=["warm"]))
        wait_for(lambda: len(compiler.worker_pids()) == 3)
        before = set(compiler.worker_pids())
        big = slow(50, props=1, k=40)  # ~1 MB compiled
        with pytest.raises(ValueError, match=r"too large: it compiles to \d+\.\d MiB; the "
                                             r"limit is 0\.0625 MiB \(--max-compiled-"):
            compiler.compile(big)
        with pytest.raises(ValueError, match="too large"):
            compiler.compile(big)
        assert (compiler.stats().hits, compiler.stats().misses) == (1, 2)  # and "warm"
        wait_for(lambda: not all(alive(p) for p in before))
        wait_for(lambda: len(compiler.worker_pids()) == 3)
    finally:
        compiler.shutdown()


def nest(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(("c", "message"), [
    (StructuredOutputs(json=nest(400)), (r"structured_outputs\.json nests more than 64 levels"
                                        r" .*the limit is 64 \(--max-schema-depth\)")),
    (StructuredOutputs(json='{"a":' * 5000 + "1" + "}" * 5000),
     r"structured_outputs\.json nests too deeply to be read"),
    (StructuredOutputs(json={"type": "string", "description": "x" * 70000}),
     (r"structured_outputs\.json takes 700\d\d bytes; the limit is 65536 "
     r"\(--max-grammar-bytes\)")),
    (StructuredOutputs(regex="a" * 70000), r"structured_outputs\.regex takes 70000 bytes"),
    (StructuredOutputs(grammar="root ::= " + '"a" ' * 20000), (r"structured_outputs\.grammar "
                                                              r"takes 8\d+ bytes")),
    (StructuredOutputs(choice=["x" * 100] * 700), r"structured_outputs\.choice takes 70700"),
    (StructuredOutputs(json={"type": "string", "pattern": "^([a-z]{1,20}){1,20}$"}),
     (r"the pattern '\^\(\[a-z\]\{1,20\}\)\{1,20\}\$' nests bounded repetitions whose counts "
     r"multiply to 400; the limit is 64")),
    (StructuredOutputs(json={"type": "string", "maxLength": 10**12}),
     r"maxLength=1000000000000 is past 2147483647"),
    (StructuredOutputs(json={"type": "object", "patternProperties": {
        "^((ab){1,9}c){1,9}$": {"type": "integer"}}}), r"multiply to 81"),
])
def test_limits_refuse_with_a_message_naming_them(c, message):
    with pytest.raises(ValueError, match=message):
        c.validate()
        ConstraintLimits().check(c)


def test_limits_let_ordinary_constraints_through():
    limits = ConstraintLimits()
    for _, schema, _ in cases.SCHEMAS:
        limits.check(StructuredOutputs(json=schema))
    limits.check(StructuredOutputs(json=nest(31)))
    limits.check(StructuredOutputs(json={"type": "string", "pattern": "^[a-z]{1,100000}$"}))
    limits.check(StructuredOutputs(json={"type": "string",
                                         "pattern": r"^([0-9]{1,3}\.){3}[0-9]{1,3}$"}))
    assert nested_repetition(r"^(\(x{2}\)){3}[({]{9}$") == 6  # escaped and classed brackets
    assert nested_repetition("((a{1,4}){1,4}){1,4}") == 64
    assert nested_repetition("(a{2,}){5}") == 10 and nested_repetition("(a{,3}){3}") == 9


def test_shutdown_ends_the_compiles_and_the_processes(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, {EOS}, timeout_s=60.0)
    compiler.compile(StructuredOutputs(choice=["warm"]))
    wait_for(lambda: len(compiler.worker_pids()) == 3)
    processes = [compiler.zygote_pid, *compiler.worker_pids()]

    async def main() -> None:
        waiting = asyncio.create_task(compiler.compile_async(slow(60)))
        await asyncio.sleep(0.3)
        compiler.shutdown()
        with pytest.raises(RuntimeError, match="stopped"):
            await asyncio.wait_for(waiting, 10)

    asyncio.run(main())
    wait_for(lambda: not any(alive(p) for p in processes), timeout=15)
    with pytest.raises(RuntimeError, match="stopped"):
        compiler.compile(StructuredOutputs(choice=["after"]))
