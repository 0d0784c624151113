"""Batch invariance checked through the HTTP server (issue 45, "How it will be checked"): one
server per dtype (float32, bfloat16) on the CPU backend with a 16-token step budget, and
probes (a short prompt and one over several chunked-prefill steps; the base model and an
adapter; greedy, seeded temperature 1, and seeded with ``n: 2``) sent with the ``openai`` SDK
alone, again (the long prompt's full blocks now a prefix-cache hit), and in the middle of
concurrent requests for other adapters and lengths (each probe twice: with prompt logprobs,
which take no cache hit, and without, a hit). Each time the tokens and every logprob (the
sampled token's, the top-5, and the prompt's logprobs with their top-5, vLLM's
``prompt_logprobs``) are the same bits (JSON floats round-trip float64 exactly; compared
with ``==``). Then each sampled sequence is
re-scored with raw HTTP (prompt + output as token ids, ``echo``, ``max_tokens: 0``) and the
re-score's logprobs of the generated tokens (``echo``'s and ``prompt_logprobs``') equal, bit
for bit, those reported while sampling. With ``--batch-invariant off`` the re-score differs:
the test can fail.

Tokens travel as ids (``return_tokens_as_token_ids``) so that no re-tokenization and no two
tokens that print alike can blur the comparison."""

from __future__ import annotations

import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import openai
import pytest
from loraplex.kernel_backends import cpu as cpu_backend

pytestmark = pytest.mark.skipif(not cpu_backend.available(),
                                reason="the CPU kernels do not build here")

API = "api-secret"
NEW = 8
TOP = 5
BUDGET = 16  # --max-num-batched-tokens: the 70-token prompt takes five prefill steps
BLOCK = 16  # the engine's default KV block size
RNG = random.Random(4545)
SHORT = [RNG.randrange(4, 384) for _ in range(7)]
LONG = [RNG.randrange(4, 384) for _ in range(70)]


class Probe(NamedTuple):
    name: str
    prompt: list[int]
    model: str  # "" = the base model
    seed: int | None  # None = greedy
    n: int = 1


PROBES = [Probe("short base greedy", SHORT, "", None),
          Probe("short adapter seeded", SHORT, "a", 1234),
          Probe("long adapter greedy", LONG, "a", None),
          Probe("long base seeded", LONG, "", 99),
          Probe("long adapter seeded n=2", LONG, "a", 7, n=2)]
CHOICES = [(i, c) for i, p in enumerate(PROBES) for c in range(p.n)]  # (probe, choice)
# the concurrent load: other adapters, lengths and sampling
LOAD = [([RNG.randrange(4, 384) for _ in range(n)], m, s)
        for n, m, s in ((5, "b", 1234), (90, "a", None), (33, "b", 7), (1, "a", None),
                        (48, "", 3), (12, "b", None), (70, "a", 5), (2, "", None),
                        (25, "a", 11), (60, "b", None), (9, "", 1234), (40, "b", 2))]

# (token ids, sampled logprobs, top-k maps): one choice's reported output
Output = tuple[tuple[int, ...], tuple[float, ...], tuple[tuple[tuple[str, float], ...], ...]]
# per prompt position: None (the first) or the sorted (token id, logprob, rank) of its top-k
PromptLogprobs = tuple[tuple[tuple[str, float, int], ...] | None, ...]


class Reported(NamedTuple):
    """What the server reported for one probe: each choice's output, the prompt logprobs."""
    choices: tuple[Output, ...]
    prompt: PromptLogprobs | None  # None: not asked (so the prefix cache may serve it)


def token_id(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token.removeprefix("token_id:"))


def output_of(logprobs: Any, start: int = 0) -> Output:
    """The ids, logprobs and top-k of ``logprobs`` (SDK object or JSON dict) from ``start``."""
    lp = logprobs if isinstance(logprobs, dict) else logprobs.model_dump()
    return (tuple(token_id(t) for t in lp["tokens"][start:]),
            tuple(lp["token_logprobs"][start:]),
            tuple(tuple(sorted(t.items())) for t in lp["top_logprobs"][start:]))


def prompt_of(entries: list[dict[str, dict[str, Any]] | None]) -> PromptLogprobs:
    return tuple(None if e is None else
                 tuple(sorted((t, v["logprob"], v["rank"]) for t, v in e.items()))
                 for e in entries)


def difference(a: Output, b: Output) -> str:
    """Where two outputs differ first, and by how much (for the failure message)."""
    if a[0] != b[0]:
        return f"tokens {a[0]} != {b[0]}"
    diffs = [abs(x - y) for x, y in zip(a[1], b[1], strict=True)]
    diffs += [abs(x[1] - y[1]) for ta, tb in zip(a[2], b[2], strict=True)
              for x, y in zip(ta, tb, strict=False) if x[0] == y[0]]
    keys = [i for i, (ta, tb) in enumerate(zip(a[2], b[2], strict=True))
            if [k for k, _ in ta] != [k for k, _ in tb]]
    return f"logprobs differ by up to {max(diffs):.3g}; top-k token sets differ at {keys}"


def sample(oai: openai.OpenAI, probe: Probe, with_prompt: bool) -> Reported:
    """``probe`` through the SDK; ``with_prompt``: with its prompt logprobs (a request that
    asks for them computes its whole prompt: no prefix-cache hit)."""
    seeded = {"temperature": 1.0, "seed": probe.seed} if probe.seed is not None \
        else {"temperature": 0.0}
    extra = {"min_tokens": NEW, "return_tokens_as_token_ids": True}
    if with_prompt:
        extra["prompt_logprobs"] = TOP
    out = oai.completions.create(model=probe.model, prompt=probe.prompt, max_tokens=NEW,
                                 logprobs=TOP, n=probe.n, **seeded, extra_body=extra)
    choices = sorted(out.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == list(range(probe.n))
    prompt = choices[0].model_extra.get("prompt_logprobs")
    assert (prompt is not None) == with_prompt
    return Reported(tuple(output_of(c.logprobs) for c in choices),
                    None if prompt is None else prompt_of(prompt))


def rescore(url: str, probe: Probe, sampled: Output) -> tuple[Output, PromptLogprobs]:
    """The re-score of prompt + sampled ids (echo, no new token), at the generated
    positions: echo's logprobs and vLLM's prompt_logprobs."""
    body = {"model": probe.model, "prompt": probe.prompt + list(sampled[0]), "echo": True,
            "max_tokens": 0, "logprobs": TOP, "prompt_logprobs": TOP, "temperature": 0.0,
            "return_tokens_as_token_ids": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120,
                       headers={"authorization": f"Bearer {API}"})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    start = len(probe.prompt)
    return output_of(choice["logprobs"], start), prompt_of(choice["prompt_logprobs"][start:])


class Observed(NamedTuple):
    url: str
    alone: list[Reported]  # with prompt logprobs
    again: list[Reported]  # without: the long prompts' full blocks from the cache
    busy: list[Reported]  # under load, with prompt logprobs
    busy_hit: list[Reported]  # under load, without (cache hits)
    again_computed: int  # prompt tokens the engine computed for ``again``


@pytest.fixture(scope="module")
def cpu_kernels() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORAPLEX_KERNELS", "cpu")
        yield


@pytest.fixture(scope="module")
def adapters(tiny_adapters: Callable[[str], Path]) -> dict[str, str]:
    return {"a": str(tiny_adapters("a0")), "b": str(tiny_adapters("a1"))}


def start(serve, make_engine, tiny_llama: Path, adapters: dict[str, str], dtype: str,
          **kw: Any) -> tuple[Any, openai.OpenAI]:
    server = serve(lambda: make_engine(tiny_llama, lora_modules=adapters, dtype=dtype,
                                       max_num_batched_tokens=BUDGET, **kw),
                   http_port=0, api_token=API)
    return server, openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=API,
                                 max_retries=0, timeout=120)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def observed(request, cpu_kernels, serve, make_engine, tiny_llama: Path,
             adapters: dict[str, str]) -> Observed:
    """One server per dtype: every probe alone, alone again, then all of them (twice) in
    the middle of the concurrent load (half the load sent before them, half after)."""
    server, oai = start(serve, make_engine, tiny_llama, adapters, request.param)
    alone = [sample(oai, p, True) for p in PROBES]
    before = server.engine.stats()["prompt_tokens_computed"]
    again = [sample(oai, p, False) for p in PROBES]
    again_computed = server.engine.stats()["prompt_tokens_computed"] - before
    with ThreadPoolExecutor(len(LOAD) + 2 * len(PROBES)) as pool:
        def load(part: list) -> list:
            return [pool.submit(oai.completions.create, model=m, prompt=p, seed=s,
                                temperature=0.0 if s is None else 1.0, max_tokens=16,
                                logprobs=TOP) for p, m, s in part]
        first = load(LOAD[:len(LOAD) // 2])
        probes = [pool.submit(sample, oai, p, w) for w in (True, False) for p in PROBES]
        second = load(LOAD[len(LOAD) // 2:])
        busy = [f.result() for f in probes]
        assert all(f.result().choices[0].text is not None for f in first + second)
    return Observed(server.http_url, alone, again, busy[:len(PROBES)], busy[len(PROBES):],
                    again_computed)


def choice_id(ic: tuple[int, int]) -> str:
    return f"{PROBES[ic[0]].name} choice {ic[1]}"


@pytest.mark.parametrize("ic", CHOICES, ids=choice_id)
def test_a_probe_is_the_same_bits_alone_again_and_under_load(observed: Observed,
                                                             ic: tuple[int, int]):
    i, c = ic
    alone = observed.alone[i].choices[c]
    assert len(alone[0]) == NEW and all(len(t) >= TOP for t in alone[2])
    for run in (observed.again[i], observed.busy[i], observed.busy_hit[i]):
        assert run.choices[c] == alone, difference(run.choices[c], alone)


def test_the_second_pass_hit_the_prefix_cache(observed: Observed):
    """Each 70-token prompt's four full blocks came from the cache (so ``again`` above
    compared a cache hit, its chunks over cached blocks, with the whole prompt computed)."""
    asked = sum(len(p.prompt) for p in PROBES)
    long_ones = sum(len(p.prompt) == len(LONG) for p in PROBES)
    assert observed.again_computed == asked - long_ones * (len(LONG) // BLOCK) * BLOCK


@pytest.mark.parametrize("i", range(len(PROBES)), ids=[p.name for p in PROBES])
def test_the_prompt_logprobs_are_the_same_bits_alone_and_under_load(observed: Observed,
                                                                          i: int):
    alone = observed.alone[i].prompt
    assert len(alone) == len(PROBES[i].prompt) and alone[0] is None
    assert all(len(e) >= TOP for e in alone[1:])
    assert observed.busy[i].prompt == alone


@pytest.mark.parametrize("ic", CHOICES, ids=choice_id)
def test_a_rescore_gives_the_sampled_logprobs_bit_for_bit(observed: Observed,
                                                          ic: tuple[int, int]):
    i, c = ic
    sampled = observed.alone[i].choices[c]
    echoed, prompt = rescore(observed.url, PROBES[i], sampled)
    assert echoed == sampled, difference(echoed, sampled)
    # vLLM's prompt_logprobs of the same re-score: the sampled token's value
    assert [e[[t for t, _, _ in e].index(str(tok))][1] for e, tok in zip(
        prompt, sampled[0], strict=True)] == list(sampled[1])


def test_with_batch_invariant_off_the_rescore_differs(cpu_kernels, serve, make_engine,
                                                      tiny_llama: Path,
                                                      adapters: dict[str, str]):
    """--batch-invariant off (the decode kernel, the fastest GEMM layouts): the re-score of
    the long seeded probe moves in float32, so the test above can fail."""
    server, oai = start(serve, make_engine, tiny_llama, adapters, "float32",
                        batch_invariant="off")
    probe = PROBES[3]
    sampled = sample(oai, probe, False).choices[0]
    rescored, _ = rescore(server.http_url, probe, sampled)
    assert rescored[0] == sampled[0]  # the same tokens, re-scored
    assert rescored[1:] != sampled[1:]
