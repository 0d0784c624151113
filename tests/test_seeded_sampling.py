"""Seeded sampling depends only on (seed, choice index, output position) (issue 45 item 2).

The sampler once gave each seeded sequence a torch.Generator of its own, advanced once per
draw and kept by seq_id: the token at position p was the draw after however many draws that
sampler had made for that id, so it depended on the sampler's history (a repeated or skipped
draw, a sampler that had not seen the sequence from its first token) rather than on p. The
first two tests check that cause directly, at the sampler; the others check the engine's
output bits alone, twice, chunked, on a prefix-cache hit, beside other adapters' and
lengths' requests, after preemption, and for each of n choices.
"""

from __future__ import annotations

import random
import struct

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from loraplex.engine.sampler import Sampler, seeded_uniform
from loraplex.engine.sequence import Sequence
from loraplex.kernel_backends.torch import TorchBackend

VOCAB = 64
NEW = 12


def sampler() -> Sampler:
    return Sampler(0, TorchBackend(torch.device("cpu"), torch.float32))


def seeded_seq(rid: str, out: list[int], seed: int = 7, index: int = 0) -> Sequence:
    s = Sequence(request_id=rid, prompt_token_ids=[1, 2, 3], index=index,
                 params=SamplingParams(temperature=1.0, seed=seed))
    s.output_token_ids = list(out)
    return s


def test_seeded_uniform_is_a_function_of_stream_and_position():
    draws = [seeded_uniform(s, p) for s in (0, 1, 2**63 - 1) for p in range(200)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) == len(draws)
    assert draws == [seeded_uniform(s, p) for s in (0, 1, 2**63 - 1) for p in range(200)]
    # roughly uniform: 20,000 draws, each decile within 10 % of its share
    many = [seeded_uniform(s, p) for s in range(100) for p in range(200)]
    counts = [0] * 10
    for u in many:
        counts[int(u * 10)] += 1
    assert all(abs(c - 2000) < 200 for c in counts), counts


def test_draw_depends_on_position_not_on_the_samplers_history():
    """The token drawn at output position p is the same for a sampler that walked the
    sequence from its first token, one that sees it first at p, and a repeated call at p
    (the old per-sequence generator gave each of these another uniform)."""
    logits = torch.zeros(1, VOCAB)  # uniform: each draw's token is its uniform's bucket
    walked = sampler()
    seq = seeded_seq("a", [])
    walk = []
    for _ in range(6):
        tok = walked(logits.clone(), [seq]).tokens[0]
        walk.append(tok)
        seq.output_token_ids.append(tok)
    assert len(set(walk)) > 1
    for p in range(6):
        fresh = sampler()  # sees the sequence first at position p
        first = fresh(logits.clone(), [seeded_seq("a", walk[:p])]).tokens[0]
        again = fresh(logits.clone(), [seeded_seq("a", walk[:p])]).tokens[0]
        assert first == again == walk[p], p
        # beside other rows, seeded or not, in either order
        mixed = [seeded_seq("b", [5], seed=3), Sequence(request_id="c", prompt_token_ids=[1],
                 params=SamplingParams(temperature=1.0)), seeded_seq("a", walk[:p])]
        assert fresh(logits.repeat(3, 1), mixed).tokens[2] == walk[p]
        assert fresh(logits.repeat(3, 1), mixed[::-1]).tokens[0] == walk[p]


def test_choice_i_is_stream_seed_plus_i():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1)) * 2
    for p in range(4):
        out = [0] * p
        a = sampler()(logits.clone(), [seeded_seq("x", out, seed=10, index=2)]).tokens[0]
        b = sampler()(logits.clone(), [seeded_seq("y", out, seed=12)]).tokens[0]
        assert a == b


# ---- through LLMEngine -------------------------------------------------------------------

def bits(out) -> tuple:
    """A choice's tokens and the bits of every logprob it reports (top ones too)."""
    lps = []
    for lp in out.logprobs:
        lps.append(struct.pack("<d", lp.logprob))
        lps += [struct.pack("<id", t, v) for t, v in lp.top]
    return tuple(out.token_ids), tuple(lps)


def probe_params(seed: int = 1234, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, n=n, logprobs=3, max_new_tokens=NEW,
                          min_new_tokens=NEW)


RNG = random.Random(45)
PROBE = [RNG.randrange(4, 384) for _ in range(70)]  # over several 16-token chunks
OTHERS = [[RNG.randrange(4, 384) for _ in range(n)] for n in (3, 40, 17, 90, 1, 33)]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    from tests.conftest import make_adapter

    root = tmp_path_factory.mktemp("seeded_adapters")
    return {f"a{i}": str(make_adapter(tiny_llama, root / f"a{i}", seed=i)) for i in range(2)}


def engine_for(tiny_llama, adapters, **kw) -> LLMEngine:
    return LLMEngine(model=tiny_llama, dtype="bfloat16", max_model_len=256,
                     max_lora_rank=64, lora_modules=adapters, **kw)


@pytest.mark.parametrize("adapter", [None, "a1"])
def test_seeded_request_is_the_same_bits_in_every_batch(tiny_llama, adapters, adapter):
    """bfloat16: alone (whole prompt in one step), alone twice with a 16-token chunk budget
    (the second a prefix-cache hit), and in the middle of other adapters' and lengths'
    requests, seeded and not: the same tokens and logprob bits."""
    alone = bits(engine_for(tiny_llama, adapters, enable_prefix_caching=False)
                 .generate([PROBE], probe_params(), adapters=[adapter])[0])
    chunked = engine_for(tiny_llama, adapters, max_num_batched_tokens=16)
    first = bits(chunked.generate([PROBE], probe_params(), adapters=[adapter])[0])
    hit = chunked.generate([PROBE], probe_params(), adapters=[adapter])[0]
    assert hit.num_cached_tokens > 0
    assert first == alone and bits(hit) == alone
    others = [SamplingParams(temperature=t, seed=s, max_new_tokens=NEW)
              for t, s in zip((1.0, 0.0, 0.7, 1.0, 1.0, 0.5), (1234, None, 3, None, 9, 1))]
    names = ["a0", None, "a1", "a0", None, "a1"]
    for budget in (16, 64, 512):
        busy = engine_for(tiny_llama, adapters, max_num_batched_tokens=budget)
        outs = busy.generate(OTHERS[:3] + [PROBE] + OTHERS[3:],
                             others[:3] + [probe_params()] + others[3:],
                             adapters=names[:3] + [adapter] + names[3:])
        assert bits(outs[3]) == alone, budget


def test_seeded_request_after_preemption(tiny_llama, adapters):
    """Few KV blocks: the probe or its neighbours are preempted and recompute."""
    alone = bits(engine_for(tiny_llama, adapters).generate([PROBE], probe_params())[0])
    engine = engine_for(tiny_llama, adapters, num_kv_blocks=12, max_num_batched_tokens=32,
                        enable_prefix_caching=False)
    others = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=40, min_new_tokens=40)
              for i in range(len(OTHERS))]
    outs = engine.generate([PROBE] + OTHERS, [probe_params()] + others)
    prompts = len(PROBE) + sum(map(len, OTHERS))
    assert engine.stats()["prompt_tokens_computed"] > prompts  # some prompts recomputed
    assert bits(outs[0]) == alone


def test_each_choice_is_independent_of_the_others(tiny_llama, adapters):
    """Choice i of n: the single choice of seed + i, with n = 1, 2 or 4 and beside others."""
    engine = engine_for(tiny_llama, adapters, max_num_batched_tokens=16)
    single = [bits(engine.generate([PROBE], probe_params(1234 + i))[0]) for i in range(4)]
    assert len(set(single)) > 1
    for n in (2, 4):
        outs = engine.generate([PROBE], probe_params(n=n))[0]
        assert [bits(o) for o in outs] == single[:n]
    outs = engine.generate([OTHERS[1], PROBE, OTHERS[3]],
                           [probe_params(5, n=3), probe_params(n=3), probe_params(1235)],
                           adapters=["a0", None, "a1"])
    assert [bits(o) for o in outs[1]] == single[:3]
