"""The serving benchmark's load client: replays a trace against a loraplex server over gRPC
streaming and measures what each request saw (``loraplex bench`` hands off here).

Scheduling follows vLLM ``benchmark_serving``: a request is sent at its trace arrival time;
``max_concurrency`` caps the requests in flight (later arrivals wait for a free place, so
their TTFT includes that wait, as in vLLM). Requests are greedy with ``max_new_tokens =
output_len``; ``ignore_eos`` makes that length exact.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import grpc
from tqdm import tqdm

from ..client import AsyncClient
from .metrics import DEFAULT_PERCENTILES, RequestResult, per_adapter, summarize
from .workload import Request, WorkloadSpec, synthetic, warmup_requests


@dataclass(frozen=True)
class RunOptions:
    max_concurrency: int | None = None  # None: no cap
    ignore_eos: bool = False
    progress: bool = True
    timeout_s: float | None = None  # deadline per request


@dataclass
class RunSpec:
    """One measured run of a benchmark: its trace and how it is sent."""

    label: str
    requests: list[Request]
    options: RunOptions
    num_adapters: int  # distinct adapter names the trace could draw from
    request_rate: float = math.inf
    extra: dict = field(default_factory=dict)  # anything else worth reporting (alpha, seed)


async def send_one(client: AsyncClient, req: Request, ignore_eos: bool, run_t0: float,
                   timeout_s: float | None = None) -> RequestResult:
    """Stream one request; TTFT and ITLs from the arrival times of token-carrying messages."""
    result = RequestResult(adapter=req.adapter, prompt_len=req.prompt_len)
    start = time.perf_counter()
    result.start_s = start - run_t0
    last = start
    tokens = 0
    try:
        async for chunk in client.generate_stream(
                req.prompt, prompt_token_ids=req.prompt_token_ids, adapter=req.adapter,
                temperature=0.0, max_new_tokens=req.output_len, ignore_eos=ignore_eos,
                timeout=timeout_s):
            now = time.perf_counter()
            if chunk.token_ids:
                if tokens == 0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                tokens += len(chunk.token_ids)
            if chunk.usage.prompt_tokens:
                result.prompt_len = chunk.usage.prompt_tokens
            if chunk.usage.completion_tokens:
                tokens = max(tokens, chunk.usage.completion_tokens)
        result.latency_s = time.perf_counter() - start
        result.output_len = tokens
        result.success = tokens > 0
        if not result.success:
            result.error = "no tokens streamed"
    except grpc.RpcError as e:
        result.error = f"{e.code().name}: {e.details()}"
    return result


async def run_trace(client: AsyncClient, requests: Sequence[Request], options: RunOptions,
                    desc: str = "") -> tuple[list[RequestResult], float]:
    """Send ``requests`` at their arrival times; (results in trace order, duration in s)."""
    limit = asyncio.Semaphore(options.max_concurrency) if options.max_concurrency else None
    bar = tqdm(total=len(requests), desc=desc or None, disable=not options.progress,
               unit="req", leave=False)
    t0 = time.perf_counter()

    async def one(req: Request) -> RequestResult:
        if limit is None:
            r = await send_one(client, req, options.ignore_eos, t0, options.timeout_s)
        else:
            async with limit:
                r = await send_one(client, req, options.ignore_eos, t0, options.timeout_s)
        bar.update(1)
        return r

    tasks = []
    for req in sorted(requests, key=lambda r: r.arrival_s):  # stable: trace order at ties
        delay = t0 + req.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(req)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration


async def warm_up(client: AsyncClient, requests: Sequence[Request]) -> None:
    """Unmeasured requests (compile paths, load adapters); failures here stop the benchmark."""
    results, _ = await run_trace(client, requests, RunOptions(progress=False))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"warm-up failed: {failed[0]}")


async def measure(client: AsyncClient, run: RunSpec,
                  percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                  slos: dict[str, float] | None = None) -> dict:
    """One run, measured: its settings, metrics, per-adapter metrics and raw per-request data."""
    results, duration = await run_trace(client, run.requests, run.options, run.label)
    return {
        "label": run.label, "num_adapters": run.num_adapters,
        "num_requests": len(run.requests), "request_rate": _json_rate(run.request_rate),
        "max_concurrency": run.options.max_concurrency, "ignore_eos": run.options.ignore_eos,
        **run.extra,
        "metrics": summarize(results, duration, percentiles, slos),
        "per_adapter": per_adapter(results, duration, percentiles),
        "requests": [_request_record(r) for r in results],
    }


def _json_rate(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def _request_record(r: RequestResult) -> dict:
    """Per-request data for CDF plots, in ms (JSON has no inf/nan: TPOT of 1-token is None)."""
    d = asdict(r)
    del d["itl_s"], d["ttft_s"], d["latency_s"], d["start_s"]
    tpot = r.tpot_s
    d.update(ttft_ms=round(r.ttft_s * 1e3, 3), e2el_ms=round(r.latency_s * 1e3, 3),
             start_ms=round(r.start_s * 1e3, 3),
             tpot_ms=None if tpot is None else round(tpot * 1e3, 3),
             itl_ms=[round(g * 1e3, 3) for g in r.itl_s])
    return d


@dataclass(frozen=True)
class SweepPlan:
    """What ``loraplex bench`` runs: every (adapter count, concurrency) pair, fresh prompts
    for each (seed + run index)."""

    adapters: Sequence[str]
    adapter_counts: Sequence[int]  # each n takes adapters[:n]
    concurrencies: Sequence[int | None]
    num_requests: int
    vocab_size: int
    alpha: float = 1.0
    request_rate: float = math.inf
    burstiness: float = 1.0
    prompt_len: tuple[int, int] = (32, 32)
    output_len: tuple[int, int] = (32, 32)
    seed: int = 0
    ignore_eos: bool = False
    progress: bool = True
    timeout_s: float | None = None


def plan_runs(plan: SweepPlan) -> list[RunSpec]:
    runs = []
    for n in plan.adapter_counts:
        if not 1 <= n <= len(plan.adapters):
            raise ValueError(f"--num-adapters {n}: the server offers {len(plan.adapters)} "
                             f"adapter names, give 1..{len(plan.adapters)}")
        for c in plan.concurrencies:
            seed = plan.seed + len(runs)
            spec = WorkloadSpec(plan.num_requests, list(plan.adapters[:n]), plan.vocab_size,
                                plan.alpha, plan.request_rate, plan.burstiness,
                                plan.prompt_len, plan.output_len, seed)
            label = f"n={n}" + (f" c={c}" if c else "")
            options = RunOptions(c, plan.ignore_eos, plan.progress, plan.timeout_s)
            runs.append(RunSpec(label, synthetic(spec), options, n, plan.request_rate,
                                {"alpha": plan.alpha, "seed": seed,
                                 "burstiness": plan.burstiness}))
    return runs


async def run_all(client: AsyncClient, runs: Sequence[RunSpec], warmups: Sequence[Request],
                  percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                  slos: dict[str, float] | None = None) -> list[dict]:
    """Warm up once, then measure each run in turn."""
    if warmups:
        await warm_up(client, warmups)
    return [await measure(client, run, percentiles, slos) for run in runs]


def warmups_for(runs: Sequence[RunSpec], count: int, vocab_size: int, seed: int
                ) -> list[Request]:
    names = sorted({r.adapter for run in runs for r in run.requests})
    return warmup_requests(count, names, vocab_size, seed) if count > 0 and names else []
