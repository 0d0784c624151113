"""Ray Serve's cost and its adapter affinity, measured: ``python -m loraplex.benchmarks.ray_overhead``.

Starts the servers itself, one after the other (never two at once: 2 cores), each a
subprocess of ``loraplex serve`` on a port of its own, on the embedded default model with
random rank-8 adapters (bench/common.make_random_adapters):

1. **Overhead.** The same workload (``loraplex bench``'s client: bench/serving.py) against the
   single-process server and against ``loraplex serve --ray --num-replicas 1`` (the replica
   gets the machine's CPUs): throughput and TTFT p50, all requests at once and one at a time;
   then, over each one's OpenAI-compatible HTTP front (``--http-port``: Ray's HTTP proxy for
   the Ray server), the same number of streaming completions one at a time (TTFT to the
   first SSE chunk with text, and the whole request).
2. **Affinity.** ``--ray --num-replicas 2`` with ``--max-cpu-loras`` below the largest adapter
   count; at 1, 8 and 32 adapters, requests in random adapter order, 4 in flight. A request
   is a hit when its ``loraplex-replica`` trailer names the replica that served its adapter's
   first request ("first"), or any replica that had served the adapter before ("held");
   each adapter's first request is not counted.

Prints a table and the machine line, and writes ``benchmarks/results/<date>-ray-overhead.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

from ..bench.serving import SweepPlan, plan_runs, run_all, warmups_for
from ..client import MULTIPLEXED_MODEL_ID, AsyncClient, Client, generate_request
from ..proto import loraplex_pb2_grpc as pb_grpc
from ..server.ray.ray_options import RayOptions
from .common import default_model_dir, machine_line, make_random_adapters
from .server_process import free_port, serve_command, serve_config

TRAILER = "loraplex-replica"
RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Workload:
    num_requests: int = 32
    prompt_len: int = 32
    output_len: int = 32
    overhead_adapters: int = 8
    affinity_counts: tuple[int, ...] = (1, 8, 32)
    affinity_output_len: int = 8
    affinity_concurrency: int = 4
    # fewer device slots and host copies than the affinity runs' 32 adapters: the point is
    # which replica holds an adapter, so adapters must come and go
    max_loras: int = 4
    max_cpu_loras: int = 16


@dataclass
class Server:
    label: str
    proc: subprocess.Popen
    target: str
    log: Path
    http_url: str


def start_server(label: str, ray: RayOptions | None, adapters: dict[str, Path], wl: Workload,
                 threads: int, log_dir: Path) -> Server:
    """``loraplex serve`` (on Ray Serve with ``ray``), the embedded model, every adapter
    registered; returns once SERVING."""
    port, http_port = free_port(), free_port()
    config = serve_config(None, adapters, max_loras=wl.max_loras,
                          max_cpu_loras=wl.max_cpu_loras, ray=ray, log_level="INFO",
                          server={"port": port, "http_port": http_port})
    cmd = serve_command(config)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # Ray keeps a value already set
    log = log_dir / f"{label.replace(' ', '_')}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    server = Server(label, proc, f"127.0.0.1:{port}", log, f"http://127.0.0.1:{http_port}")
    start = time.perf_counter()
    with Client(server.target) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{label} exited {proc.returncode}; see {log}")
            try:
                client.wait_until_serving(5)
                break
            except (TimeoutError, grpc.RpcError):
                if time.perf_counter() - start > 600:
                    stop_server(server)
                    raise
    print(f"[{label}] serving on {server.target} after {time.perf_counter() - start:.0f}s")
    return server


def stop_server(server: Server) -> None:
    """SIGINT (the server tears Ray down itself), then kill after a minute."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)
        try:
            server.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()


# ---- overhead --------------------------------------------------------------------------
async def overhead_runs(target: str, names: Sequence[str], wl: Workload) -> list[dict]:
    """Every request at once, then one at a time (the same prompts on every server)."""
    async with AsyncClient(target) as client:
        info = await client.server_info()
        plan = SweepPlan(adapters=list(names), adapter_counts=[len(names)],
                         concurrencies=[None, 1], num_requests=wl.num_requests,
                         vocab_size=info.vocab_size, prompt_len=(wl.prompt_len,) * 2,
                         output_len=(wl.output_len,) * 2, ignore_eos=True, progress=False)
        runs = plan_runs(plan)
        return await run_all(client, runs, warmups_for(runs, 8, info.vocab_size, 1))


def overhead_row(label: str, run: dict) -> dict[str, float | str]:
    m = run["metrics"]
    return {"server": label, "run": "all at once" if run["max_concurrency"] is None
            else f"{run['max_concurrency']} in flight",
            "tok_s": m["output_throughput"], "ttft_p50": m["ttft_ms"]["median"],
            "failed": m["failed"]}


def http_one_at_a_time(url: str, names: Sequence[str], wl: Workload, seed: int = 0
                       ) -> dict[str, float]:
    """``num_requests`` streaming completions over the OpenAI HTTP front, one at a time:
    the median ms to the first chunk with text (TTFT) and to the end (E2E)."""
    rng = random.Random(seed)
    ttft, e2e = [], []
    with httpx.Client(base_url=url, timeout=120) as http:
        for i in range(wl.num_requests):
            body = {"model": names[i % len(names)], "max_tokens": wl.output_len,
                    "prompt": [rng.randrange(100, 40000) for _ in range(wl.prompt_len)],
                    "temperature": 0.0, "stream": True, "ignore_eos": True}
            start, first = time.perf_counter(), None
            with http.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if first is None and line.startswith("data: {") and '"text":""' not in \
                            line.replace(" ", ""):
                        first = time.perf_counter()
            ttft.append(((first or time.perf_counter()) - start) * 1e3)
            e2e.append((time.perf_counter() - start) * 1e3)
    return {"ttft_p50": statistics.median(ttft), "e2e_p50": statistics.median(e2e)}


# ---- affinity --------------------------------------------------------------------------
async def _replica_of(stub: pb_grpc.InferenceStub, adapter: str, ids: list[int],
                      output_len: int, limit: asyncio.Semaphore) -> tuple[str, str]:
    """One Generate as loraplex.client sends it (adapter as multiplexed_model_id):
    (adapter, the replica named by its trailer)."""
    request = generate_request(prompt_token_ids=ids, adapter=adapter, temperature=0.0,
                               max_new_tokens=output_len, ignore_eos=True)
    async with limit:
        call = stub.Generate(request, metadata=((MULTIPLEXED_MODEL_ID, adapter),), timeout=120)
        await call
        return adapter, dict(await call.trailing_metadata())[TRAILER]


def hit_rates(landed: Sequence[tuple[str, str]]) -> tuple[int, int, int]:
    """(first hits, held hits, counted) in completion order: a first hit lands on the replica
    that served its adapter's first request; a held hit on any replica that had served the
    adapter before. Each adapter's first request is not counted."""
    served: dict[str, list[str]] = {}
    first = held = counted = 0
    for adapter, replica in landed:
        before = served.setdefault(adapter, [])
        if before:
            counted += 1
            first += replica == before[0]
            held += replica in before
        before.append(replica)
    return first, held, counted


async def affinity_run(target: str, names: Sequence[str], wl: Workload, seed: int
                       ) -> tuple[int, int, int, int]:
    """(first hits, held hits, counted, replicas seen) over max(32, 4n) requests in random adapter order."""
    rng = random.Random(seed)
    n_req = max(wl.num_requests, 4 * len(names))
    order = [names[i % len(names)] for i in range(n_req)]
    rng.shuffle(order)
    limit = asyncio.Semaphore(wl.affinity_concurrency)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        tasks = []
        for adapter in order:
            ids = [rng.randrange(100, 40000) for _ in range(wl.prompt_len)]
            tasks.append(asyncio.ensure_future(
                _replica_of(stub, adapter, ids, wl.affinity_output_len, limit)))
        landed = []
        for coro in asyncio.as_completed(tasks):  # completion order: as the router saw it
            landed.append(await coro)
    return (*hit_rates(landed), len({r for _, r in landed}))


# ---- report ----------------------------------------------------------------------------
def markdown(machine: str, command: str, rows: list[dict], affinity: list[tuple],
             wl: Workload, http_rows: dict[str, dict[str, float]] | None = None) -> str:
    single = {r["run"]: r for r in rows if r["server"] == "single"}
    lines = [f"# Ray Serve overhead and adapter affinity ({dt.date.today()})", "",
             f"`{command}`", "", f"Machine: {machine}", "",
             (f"Model: embedded SmolLM2-135M-Instruct, random rank-8 adapters on all targets; "
             f"`--max-loras {wl.max_loras} --max-cpu-loras {wl.max_cpu_loras}`."), "",
             (f"## Overhead: {wl.num_requests} requests x {wl.prompt_len} prompt x "
             f"{wl.output_len} output tokens, {wl.overhead_adapters} adapters"), "",
             "| server | run | output tok/s | vs single | TTFT p50 ms | vs single | failed |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = single[r["run"]]
        lines.append(f"| {r['server']} | {r['run']} | {r['tok_s']:.1f} | "
                     f"{r['tok_s'] / base['tok_s']:.2f}x | {r['ttft_p50']:.1f} | "
                     f"{r['ttft_p50'] - base['ttft_p50']:+.1f} | {r['failed']} |")
    if http_rows:
        base = http_rows["single"]
        lines += ["", (f"## OpenAI HTTP: {wl.num_requests} streaming completions one at a "
                  "time, same sizes"), "",
                  "| server | TTFT p50 ms | vs single | E2E p50 ms | vs single |",
                  "|---|---:|---:|---:|---:|"]
        for label, h in http_rows.items():
            lines.append(f"| {label} | {h['ttft_p50']:.1f} | "
                         f"{h['ttft_p50'] - base['ttft_p50']:+.1f} | {h['e2e_p50']:.1f} | "
                         f"{h['e2e_p50'] / base['e2e_p50']:.2f}x |")
    if not affinity:
        return "\n".join(lines) + "\n"
    lines += ["", (f"## Affinity: 2 replicas, {wl.affinity_concurrency} requests in flight, "
              f"{wl.affinity_output_len} output tokens"), "",
              ("A request counts when its adapter was served before; **first**: it lands on the "
              "replica that served the adapter first; **held**: on a replica that had served "
              "it already."), "",
              "| adapters | requests counted | first | held | replicas used |",
              "|---:|---:|---:|---:|---:|"]
    for n, first, held, counted, used in affinity:
        lines.append(f"| {n} | {counted} | {first / max(counted, 1):.0%} | "
                     f"{held / max(counted, 1):.0%} | {used} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--adapter-dir", type=Path,
                   default=Path(tempfile.gettempdir()) / "loraplex-bench-adapters")
    p.add_argument("--out", type=Path,
                   default=RESULTS / f"{dt.date.today().isoformat()}-ray-overhead.md")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--skip-affinity", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wl = Workload()
    model_dir = default_model_dir()
    adapters = make_random_adapters(model_dir, max(wl.affinity_counts), args.adapter_dir)
    names = sorted(adapters)
    cores = os.cpu_count() or 1
    log_dir = Path(tempfile.mkdtemp(prefix="loraplex-ray-bench-"))
    rows: list[dict] = []
    http_rows: dict[str, dict[str, float]] = {}
    dtype = "?"
    servers = [("single", None, cores),
               ("ray 1 replica", RayOptions(num_replicas=1, replica_cpus=cores), cores)]
    for label, ray, threads in [] if args.skip_overhead else servers:
        server = start_server(label, ray, adapters, wl, threads, log_dir)
        try:
            with Client(server.target) as c:
                dtype = c.server_info().dtype
            runs = asyncio.run(overhead_runs(server.target, names[:wl.overhead_adapters], wl))
            http_rows[label] = http_one_at_a_time(server.http_url,
                                                  names[:wl.overhead_adapters], wl)
        finally:
            stop_server(server)
        rows += [overhead_row(label, r) for r in runs]
    affinity: list[tuple] = []
    if not args.skip_affinity:
        server = start_server("ray 2 replicas",
                              RayOptions(num_replicas=2, replica_cpus=max(cores // 2, 1)),
                              adapters, wl, max(cores // 2, 1), log_dir)
        try:
            for i, n in enumerate(wl.affinity_counts):
                affinity.append((n, *asyncio.run(affinity_run(server.target, names[:n], wl,
                                                               seed=i))))
        finally:
            stop_server(server)
    import torch

    from ..kernel_backends import backend_name

    machine = machine_line(backend_name(torch.device("cpu")), dtype)
    text = markdown(machine, "python -m loraplex.benchmarks.ray_overhead", rows, affinity, wl,
                    http_rows)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out} (server logs in {log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
