"""n > 1: one prefill of the prompt, n choices forked from it sharing its KV blocks (the
last partial block copied on write); each choice its own seeded stream; abort frees all."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from loraplex import LLMEngine, SamplingParams
from loraplex.engine.async_engine import AsyncEngine

PROMPT = list(range(20, 57))  # 37 tokens: two full blocks and a partial one
NEW = 8


def engine_for(tiny_llama: Path, **kw) -> LLMEngine:
    return LLMEngine(model=tiny_llama, dtype="float32", max_model_len=128, debug_checks=True,
                     **kw)


def sampled(seed: int, n: int = 1, **kw) -> SamplingParams:
    fields = {"temperature": 1.0, "seed": seed, "n": n, "max_new_tokens": NEW, "min_new_tokens": NEW}
    return SamplingParams(**{**fields, **kw})


def test_prompt_computed_once_and_choices_are_their_seeds(tiny_llama):
    """Choice i of seed s is the single choice of seed s + i (vLLM's rule), token for token,
    although only the parent computed the prompt: the forked KV is right."""
    engine = engine_for(tiny_llama, enable_prefix_caching=False)
    outs = engine.generate([PROMPT], sampled(7, n=4, logprobs=1))[0]
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert engine.stats()["prompt_tokens_computed"] == len(PROMPT)
    assert all(o.prompt_token_ids == PROMPT and len(o.token_ids) == NEW for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1
    alone = [engine.generate([PROMPT], sampled(7 + i))[0].token_ids for i in range(4)]
    assert [o.token_ids for o in outs] == alone
    assert engine.block_manager.num_used_blocks == 0 and not engine.requests


def test_choices_are_reproducible_in_any_batch(tiny_llama):
    engine = engine_for(tiny_llama, max_num_batched_tokens=16)  # chunked prompt, then fork
    alone = [o.token_ids for o in engine.generate([PROMPT], sampled(3, n=3))[0]]
    mixed = engine.generate([[5, 6, 7], PROMPT, list(range(100, 140))],
                            [sampled(1, n=2), sampled(3, n=3), sampled(9)])
    assert [o.token_ids for o in mixed[1]] == alone
    assert engine.block_manager.num_used_blocks == 0


def test_greedy_choices_equal_the_single_greedy_output(tiny_llama):
    engine = engine_for(tiny_llama)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW, min_new_tokens=NEW)
    one = engine.generate([PROMPT], greedy)[0].token_ids
    greedy = replace(greedy, n=3)  # SamplingParams is frozen
    assert [o.token_ids for o in engine.generate([PROMPT], greedy)[0]] == [one] * 3


def test_abort_frees_every_block(tiny_llama):
    engine = engine_for(tiny_llama)
    free = len(engine.block_manager.free)
    rid = engine.add_request(PROMPT, sampled(2, n=5, max_new_tokens=50))
    for _ in range(3):
        engine.step()
    assert len(engine.requests[rid]) == 5
    assert engine.abort(rid)
    assert len(engine.block_manager.free) == free and not engine.requests
    # seeded draws keep no per-sequence state (a function of seed, choice and position)
    assert not engine.has_unfinished_requests() and not hasattr(engine.runner.sampler, "seeded")


def test_fork_under_block_pressure_recomputes(tiny_llama):
    """No free block for a choice's copy of the partial block: it waits and recomputes."""
    engine = engine_for(tiny_llama, num_kv_blocks=5, max_num_batched_tokens=64)
    outs = engine.generate([PROMPT], sampled(11, n=3))[0]
    alone = [engine.generate([PROMPT], sampled(11 + i))[0].token_ids for i in range(3)]
    assert [o.token_ids for o in outs] == alone
    assert engine.block_manager.num_used_blocks == 0


def test_async_stream_ends_after_every_choice(tiny_llama):
    async def main() -> list:
        engine = AsyncEngine(engine_for(tiny_llama))
        engine.start()
        try:
            return [o async for o in engine.generate(PROMPT, sampled(5, n=3))]
        finally:
            engine.shutdown()

    outs = asyncio.run(main())
    finished = sorted(o.index for o in outs if o.finished)
    assert finished == [0, 1, 2] and outs[-1].finished
    assert sum(len(o.new_token_ids) for o in outs) == 3 * NEW


def test_n_over_the_seats_waits_for_room(tiny_llama):
    """A request holds n seats from admission: with 4 seats, n=3 and n=2 run one after the
    other, never more than 4 sequences at once."""
    engine = engine_for(tiny_llama, max_num_seqs=4)
    engine.add_request(PROMPT, sampled(1, n=3))
    engine.add_request([5, 6, 7, 8], sampled(2, n=2))
    while engine.has_unfinished_requests():
        engine.step()
        assert len(engine.scheduler.running) <= 4
        assert sum(s.seats for s in engine.scheduler.running) <= 4
