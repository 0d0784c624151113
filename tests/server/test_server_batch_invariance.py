"""Batch invariance checked through the HTTP server (issue 45, "How it will be checked"): one
server per dtype (float32, bfloat16) on the CPU backend with a 16-token step budget, and
probes (a short prompt and one over several chunked-prefill steps; the base model and an
adapter; greedy and seeded temperature 1) sent with the ``openai`` SDK alone, again (a
prefix-cache hit), and in the middle of concurrent requests for other adapters and lengths.
Each time the tokens and every logprob (the sampled token's and the top-5) are the same bits
(JSON floats round-trip float64 exactly; compared with ``==``). Then each sampled sequence is
re-scored with raw HTTP (prompt + output as token ids, ``echo``, ``max_tokens: 0``) and the
re-score's logprobs of the generated tokens equal, bit for bit, those reported while
sampling. With ``--batch-invariant off`` the re-score differs: the test can fail.

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
RNG = random.Random(4545)
SHORT = [RNG.randrange(4, 384) for _ in range(7)]
LONG = [RNG.randrange(4, 384) for _ in range(70)]


class Probe(NamedTuple):
    name: str
    prompt: list[int]
    model: str  # "" = the base model
    seed: int | None  # None = greedy


PROBES = [Probe("short base greedy", SHORT, "", None),
          Probe("short adapter seeded", SHORT, "a", 1234),
          Probe("long adapter greedy", LONG, "a", None),
          Probe("long base seeded", LONG, "", 99)]
# the concurrent load: other adapters, lengths and sampling
LOAD = [([RNG.randrange(4, 384) for _ in range(n)], m, s)
        for n, m, s in ((5, "b", 1234), (90, "a", None), (33, "b", 7), (1, "a", None),
                        (48, "", 3), (12, "b", None), (70, "a", 5), (2, "", None),
                        (25, "a", 11), (60, "b", None), (9, "", 1234), (40, "b", 2))]

# (token ids, sampled logprobs, top-k maps): one probe's reported output
Output = tuple[tuple[int, ...], tuple[float, ...], tuple[tuple[tuple[str, float], ...], ...]]


def token_id(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token.removeprefix("token_id:"))


def output_of(logprobs: Any, start: int = 0) -> Output:
    """The ids, logprobs and top-k of ``logprobs`` (SDK object or JSON dict) from ``start``."""
    lp = logprobs if isinstance(logprobs, dict) else logprobs.model_dump()
    return (tuple(token_id(t) for t in lp["tokens"][start:]),
            tuple(lp["token_logprobs"][start:]),
            tuple(tuple(sorted(t.items())) for t in lp["top_logprobs"][start:]))


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


def sample(oai: openai.OpenAI, probe: Probe) -> Output:
    seeded = {"temperature": 1.0, "seed": probe.seed} if probe.seed is not None \
        else {"temperature": 0.0}
    out = oai.completions.create(model=probe.model, prompt=probe.prompt, max_tokens=NEW,
                                 logprobs=TOP, **seeded,
                                 extra_body={"min_tokens": NEW,
                                             "return_tokens_as_token_ids": True})
    return output_of(out.choices[0].logprobs)


def rescore(url: str, probe: Probe, sampled: Output) -> Output:
    """The re-score of prompt + sampled ids (echo, no new token): the generated positions."""
    body = {"model": probe.model, "prompt": probe.prompt + list(sampled[0]), "echo": True,
            "max_tokens": 0, "logprobs": TOP, "temperature": 0.0,
            "return_tokens_as_token_ids": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120,
                       headers={"authorization": f"Bearer {API}"})
    assert reply.status_code == 200, reply.text
    return output_of(reply.json()["choices"][0]["logprobs"], len(probe.prompt))


class Observed(NamedTuple):
    url: str
    alone: list[Output]
    again: list[Output]
    busy: list[Output]


@pytest.fixture(scope="module")
def cpu_kernels() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORAPLEX_KERNELS", "cpu")
        yield


@pytest.fixture(scope="module")
def adapters(tiny_adapters: Callable[[str], Path]) -> dict[str, str]:
    return {"a": str(tiny_adapters("a0")), "b": str(tiny_adapters("a1"))}


def start(serve, make_engine, tiny_llama: Path, adapters: dict[str, str], dtype: str,
          **kw: Any) -> tuple[str, openai.OpenAI]:
    server = serve(lambda: make_engine(tiny_llama, lora_modules=adapters, dtype=dtype,
                                       max_num_batched_tokens=BUDGET, **kw),
                   http_port=0, api_token=API)
    return server.http_url, openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=API,
                                          max_retries=0, timeout=120)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def observed(request, cpu_kernels, serve, make_engine, tiny_llama: Path,
             adapters: dict[str, str]) -> Observed:
    """One server per dtype: every probe alone, alone again, then all of them in the middle
    of the concurrent load (half the load sent before them, half after)."""
    url, oai = start(serve, make_engine, tiny_llama, adapters, request.param)
    alone = [sample(oai, p) for p in PROBES]
    again = [sample(oai, p) for p in PROBES]
    with ThreadPoolExecutor(len(LOAD) + len(PROBES)) as pool:
        def load(part: list) -> list:
            return [pool.submit(oai.completions.create, model=m, prompt=p, seed=s,
                                temperature=0.0 if s is None else 1.0, max_tokens=16,
                                logprobs=TOP) for p, m, s in part]
        first = load(LOAD[:len(LOAD) // 2])
        probes = [pool.submit(sample, oai, p) for p in PROBES]
        second = load(LOAD[len(LOAD) // 2:])
        busy = [f.result() for f in probes]
        assert all(f.result().choices[0].text is not None for f in first + second)
    return Observed(url, alone, again, busy)


@pytest.mark.parametrize("i", range(len(PROBES)), ids=[p.name for p in PROBES])
def test_a_probe_is_the_same_bits_alone_again_and_under_load(observed: Observed, i: int):
    alone = observed.alone[i]
    assert len(alone[0]) == NEW and all(len(t) >= TOP for t in alone[2])
    assert observed.again[i] == alone, difference(observed.again[i], alone)
    assert observed.busy[i] == alone, difference(observed.busy[i], alone)


@pytest.mark.parametrize("i", range(len(PROBES)), ids=[p.name for p in PROBES])
def test_a_rescore_gives_the_sampled_logprobs_bit_for_bit(observed: Observed, i: int):
    sampled = observed.alone[i]
    rescored = rescore(observed.url, PROBES[i], sampled)
    assert rescored == sampled, difference(rescored, sampled)


def test_with_batch_invariant_off_the_rescore_differs(cpu_kernels, serve, make_engine,
                                                      tiny_llama: Path,
                                                      adapters: dict[str, str]):
    """--batch-invariant off (the decode kernel, the fastest GEMM layouts): the re-score of
    the long seeded probe moves in float32, so the test above can fail."""
    url, oai = start(serve, make_engine, tiny_llama, adapters, "float32",
                     batch_invariant="off")
    probe = PROBES[3]
    sampled = sample(oai, probe)
    rescored = rescore(url, probe, sampled)
    assert rescored[0] == sampled[0]  # the same tokens, re-scored
    assert rescored[1:] != sampled[1:]
