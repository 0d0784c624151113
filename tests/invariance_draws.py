"""The batch-invariance checks' machinery, shared by tests/test_batch_invariance.py (float
bases), tests/test_quantized_invariance.py (GGUF and --quantization bases) and
tests/test_thread_invariance.py (the intra-op thread count): a request's output as bits
(tokens, and every logprob it reports), random batch compositions around one probe drawn
from a seeded generator, the probe compared with itself alone, and the echo re-score.

The oracle is the probe alone: one request in an engine that computes its whole prompt in
one step without a prefix cache. Adapters are named "a0" and "a1" (None: the base)."""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Sequence

from loraplex import LLMEngine, SamplingParams

NEW = 6  # tokens each probe decodes
BUDGETS = (7, 16, 33, 64, 512)  # the step token budgets a draw picks from (chunked prefill)
LENGTHS = (1, 2, 5, 17, 33, 64, 70, 97)  # probe prompt lengths

Make = Callable[..., LLMEngine]  # EngineConfig keywords -> an engine over one base


def lp_bits(lp) -> tuple:
    return (lp.token_id, struct.pack("<d", lp.logprob), lp.rank,
            tuple(struct.pack("<id", t, v) for t, v in lp.top))


def bits(out) -> tuple:
    """A choice's tokens, and the bits of every logprob it reports: sampled (with top-k)
    and prompt logprobs (with top-k)."""
    prompt = tuple(None if lp is None else lp_bits(lp) for lp in out.prompt_logprobs or [])
    return tuple(out.token_ids), tuple(lp_bits(lp) for lp in out.logprobs), prompt


def choices(out) -> list:
    return [bits(o) for o in (out if isinstance(out, list) else [out])]


def params(rng: random.Random, n: int, greedy: bool) -> SamplingParams:
    return SamplingParams(temperature=0.0 if greedy else 1.0, seed=rng.randrange(1 << 30),
                          n=n, logprobs=3, prompt_logprobs=2, max_new_tokens=NEW,
                          min_new_tokens=NEW)


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(4, 384) for _ in range(length)]


def draw(rng: random.Random, budgets: Sequence[int] = BUDGETS,
         lengths: Sequence[int] = LENGTHS) -> dict:
    """One batch composition around one probe."""
    greedy = rng.random() < 0.3
    neighbours = rng.randrange(0, 6)
    return {
        "probe": prompt(rng, rng.choice(lengths)),
        "adapter": rng.choice([None, "a0", "a1"]),
        "params": params(rng, 1 if greedy else rng.choice([1, 2, 3]), greedy),
        "others": [prompt(rng, rng.randrange(1, 90)) for _ in range(neighbours)],
        "other_adapters": [rng.choice([None, "a0", "a1"]) for _ in range(neighbours)],
        "other_params": [SamplingParams(temperature=rng.choice([0.0, 1.0]),
                                        seed=rng.randrange(1 << 30), n=rng.choice([1, 2]),
                                        logprobs=rng.choice([None, 1]),
                                        max_new_tokens=rng.randrange(1, 12))
                         for _ in range(neighbours)],
        "place": rng.randrange(0, neighbours + 1),
        "budget": rng.choice(budgets),
        "warm": rng.random() < 0.5,
    }


def covers_the_cases(draws: list[dict]) -> list[str]:
    """The dimensions of the guarantee that ``draws`` miss (empty: all reached)."""
    missing = []
    if {d["warm"] for d in draws} != {True, False}:
        missing.append("cache hit and miss")
    if {d["params"].temperature for d in draws} != {0.0, 1.0}:
        missing.append("greedy and seeded")
    if not any(d["params"].n > 1 for d in draws):
        missing.append("n > 1")
    if not any(d["others"] for d in draws) or not any(d["adapter"] for d in draws):
        missing.append("neighbours, an adapter probe")
    if not any(len(d["probe"]) > d["budget"] and d["params"].temperature > 0 for d in draws):
        missing.append("a seeded chunked prompt")
    return missing


def run_draws(make: Make, draws: list[dict], first_only: bool = False) -> list[str]:
    """The draws whose probe differs from the probe alone (empty when invariant);
    ``make(**kw)``: an engine over the base, with the adapters a0 and a1. With
    ``first_only``, the first such draw only (the draws after it are not run)."""
    alone_engine = make(enable_prefix_caching=False)
    engines: dict[int, LLMEngine] = {}
    failures = []
    for i, d in enumerate(draws):
        alone = choices(alone_engine.generate([d["probe"]], d["params"], [d["adapter"]])[0])
        key = d["budget"]
        if key not in engines:
            engines[key] = make(max_num_batched_tokens=key)
        busy = engines[key]
        if d["warm"]:  # the probe's prompt blocks in the prefix cache, under another seed
            busy.generate([d["probe"]], SamplingParams(max_new_tokens=1), [d["adapter"]])
        at = d["place"]
        prompts = d["others"][:at] + [d["probe"]] + d["others"][at:]
        ps = d["other_params"][:at] + [d["params"]] + d["other_params"][at:]
        names = d["other_adapters"][:at] + [d["adapter"]] + d["other_adapters"][at:]
        got = choices(busy.generate(prompts, ps, names)[at])
        if got != alone:
            failures.append(f"draw {i}: {len(d['probe'])} tokens, adapter {d['adapter']}, "
                            f"n {d['params'].n}, budget {d['budget']}, warm {d['warm']}, "
                            f"{len(d['others'])} neighbours")
            if first_only:
                break
    return failures


RESCORES = ((5, None, True), (40, "a0", False), (70, "a1", False), (2, "a1", True))


def rescore_mismatches(eng: LLMEngine, cases=RESCORES) -> list[str]:
    """Sample with logprobs, then send prompt + output back as a prompt with prompt_logprobs
    (an echo re-score): the sampled tokens' logprobs (and their top-k) against the re-score's
    prompt logprobs of the same positions. ``cases``: (prompt length, adapter, greedy)."""
    rng = random.Random(3)
    bad = []
    for length, adapter, greedy in cases:
        p = prompt(rng, length)
        sp = SamplingParams(temperature=0.0 if greedy else 1.0, seed=11, logprobs=3,
                            max_new_tokens=10, min_new_tokens=10)
        out = eng.generate([p], sp, [adapter])[0]
        echo = eng.generate([p + list(out.token_ids)],
                            SamplingParams(prompt_logprobs=3, max_new_tokens=1), [adapter])[0]
        rescored = [lp_bits(lp) for lp in echo.prompt_logprobs[length:]]
        if rescored != [lp_bits(lp) for lp in out.logprobs]:
            bad.append(f"{length} tokens, adapter {adapter}, greedy {greedy}")
    return bad
