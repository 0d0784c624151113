"""loraplex against llama.cpp on the same GGUF file, on this machine (issue 44, item 5).

    python -m loraplex.benchmarks.llamacpp_compare --llama-cpp DIR [--quant Q4_K_M]
        [--requests 32 --prompt-len 128 --new-tokens 128] [--only single,base,mixed,int4]

DIR is a llama.cpp source tree with ``build/bin/{llama-bench,llama-server,llama-quantize}``.
The model (Llama-3.2-1B's shapes, random weights), its GGUFs and the PEFT adapters are made
once under ``--work`` (benchmarks/llamacpp_models.py). Measured, each in a fresh process,
the baseline first (and again after, with ``--both-orders``):

- single: decode tok/s at batch 1, llama-bench's tg128 against ``LLMEngine`` on the same
  .gguf (new tokens after the first, timed past the prefill) -- target >= 0.9x;
- base: ``--requests`` concurrent requests (prompt + new tokens, EOS ignored) to
  ``loraplex serve`` against ``llama-server -np N`` (continuous batching), output tok/s --
  target >= 2x;
- mixed: the same, request i on adapter i mod ``--adapters`` -- target >= 4x;
- int4: loraplex at batch 1 on the HF dir, ``--quantization int4`` against bf16 -- >= 2.5x.

llama-server's LoRA traps: a request without a ``lora`` field runs with every loaded
adapter applied, so every request here names every adapter, at scale 0 but for its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from .common import machine_line, random_prompts

STEPS = ("single", "base", "mixed", "int4")
TARGETS = {"single": 0.9, "base": 2.0, "mixed": 4.0, "int4": 2.5}
PROMPT_VOCAB = 49152  # the SmolLM2 tokenizer's real tokens (the rest are [PAD] fillers)


@dataclass(frozen=True)
class Row:
    """One comparison: ``ours`` / ``baseline`` against ``target``."""

    step: str
    what: str
    baseline_name: str
    baseline: float  # tok/s
    ours: float  # tok/s
    unit: str = "tok/s"

    @property
    def ratio(self) -> float:
        return ratio(self.ours, self.baseline)

    @property
    def met(self) -> bool:
        return self.ratio >= TARGETS[self.step]


def ratio(ours: float, baseline: float) -> float:
    return ours / baseline if baseline > 0 else float("nan")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp tree, built")
    ap.add_argument("--convert-python", default=sys.executable,
                    help="the interpreter for llama.cpp's converters (needs sentencepiece)")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) /
                    "loraplex-llamacpp", help="where the model and its files are kept")
    ap.add_argument("--quant", default="Q4_K_M", choices=("Q8_0", "Q4_K_M"),
                    help="the GGUF both engines serve")
    ap.add_argument("--only", default=",".join(STEPS), type=_steps)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--single-new-tokens", type=int, default=128, help="tg of llama-bench")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--both-orders", action="store_true",
                    help="measure the baseline again after loraplex")
    ap.add_argument("--json", type=Path, help="write the rows and the machine here")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # a loraplex measurement, as JSON
    return ap.parse_args(argv)


def _steps(value: str) -> tuple[str, ...]:
    steps = tuple(s for s in value.split(",") if s)
    bad = [s for s in steps if s not in STEPS]
    if bad or not steps:
        raise argparse.ArgumentTypeError(f"unknown steps {bad}: choose from {','.join(STEPS)}")
    return steps


# --- llama-server's request bodies -----------------------------------------------------

def lora_field(n_adapters: int, adapter: int | None) -> list[dict[str, float | int]]:
    """The ``lora`` field of a llama-server request: every loaded adapter named (an absent
    field applies them all), scale 1 for ``adapter`` and 0 for the rest (None: the base)."""
    return [{"id": i, "scale": 1.0 if i == adapter else 0.0} for i in range(n_adapters)]


def completion_body(prompt: list[int], new_tokens: int, n_adapters: int,
                    adapter: int | None) -> dict:
    """A greedy ``/completion`` request of ``new_tokens`` tokens, EOS ignored, no cache."""
    body = {"prompt": prompt, "n_predict": new_tokens, "ignore_eos": True, "temperature": 0.0,
            "cache_prompt": False, "stream": False}
    if n_adapters:
        body["lora"] = lora_field(n_adapters, adapter)
    return body


def request_adapters(requests: int, n_adapters: int) -> list[int | None]:
    """Request i's adapter index: i mod n (None for every request when n is 0)."""
    return [i % n_adapters if n_adapters else None for i in range(requests)]


# --- the report --------------------------------------------------------------------------

def format_table(rows: list[Row]) -> str:
    lines = ["| measurement | baseline | baseline's figure | loraplex | ratio | target |",
             "|---|---|---:|---:|---:|---|"]
    for r in rows:
        mark = "met" if r.met else "missed"
        lines.append(f"| {r.what} | {r.baseline_name} | {r.baseline:.1f} {r.unit} | "
                     f"{r.ours:.1f} {r.unit} | {r.ratio:.2f}x | >= {TARGETS[r.step]}x ({mark}) |")
    return "\n".join(lines)


# --- llama.cpp's side --------------------------------------------------------------------

def llama_bench_tg(bench: Path, gguf: Path, new_tokens: int, threads: int) -> float:
    """llama-bench's tg<new_tokens> on ``gguf`` (mean tok/s of its 2 repetitions)."""
    out = subprocess.run([str(bench), "-m", str(gguf), "-p", "0", "-n", str(new_tokens),
                          "-t", str(threads), "-r", "2", "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def llama_server_tps(server: Path, gguf: Path, lora_ggufs: list[Path], args: argparse.Namespace,
                     n_adapters: int, log: Path) -> float:
    """Output tok/s of ``args.requests`` concurrent requests to a fresh llama-server."""
    from .server_process import free_port

    port = free_port()
    per_seq = args.prompt_len + args.new_tokens + 16
    cmd = [str(server), "-m", str(gguf), "-np", str(args.requests), "-c",
           str(per_seq * args.requests), "-t", str(args.threads), "-cb", "--port", str(port),
           "--host", "127.0.0.1", "--no-warmup"]
    for lora in lora_ggufs:
        cmd += ["--lora", str(lora)]
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_health(url, proc)
        prompts = random_prompts(args.requests, args.prompt_len, PROMPT_VOCAB, seed=7)
        adapters = request_adapters(args.requests, n_adapters)
        bodies = [completion_body(p, args.new_tokens, len(lora_ggufs), a)
                  for p, a in zip(prompts, adapters)]
        start = time.perf_counter()
        with ThreadPoolExecutor(len(bodies)) as pool:
            counts = list(pool.map(lambda b: _post(url + "/completion", b)["tokens_predicted"],
                                   bodies))
        return sum(counts) / (time.perf_counter() - start)
    finally:
        proc.terminate()
        proc.wait(60)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as resp:
        return json.load(resp)


def _wait_health(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError("llama-server did not become healthy")


# --- loraplex's side ---------------------------------------------------------------------

def loraplex_decode_tps(model: str, quantization: str, new_tokens: int) -> float:
    """Decode tok/s at batch 1: (new_tokens) / (time of 1 + new_tokens tokens - time of 1
    token), each on a fresh 16-token prompt (the prefill is in both and cancels)."""
    from .. import LLMEngine, SamplingParams
    from ..engine.engine_config import EngineConfig

    engine = LLMEngine.from_config(EngineConfig(model=model, quantization=quantization,
                                                max_num_seqs=1, max_model_len=1024))
    prompts = iter(random_prompts(8, 16, PROMPT_VOCAB, seed=3))

    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        engine.generate([next(prompts)], params)
        return time.perf_counter() - start

    run(8)  # warm-up
    first = min(run(1) for _ in range(2))
    return new_tokens / (run(1 + new_tokens) - first)


def loraplex_server_tps(gguf: Path, adapters: dict[str, Path], args: argparse.Namespace,
                        n_adapters: int, log: Path) -> float:
    from .server_process import serve_config, served

    names = list(adapters)[:n_adapters]
    config = serve_config(gguf, {n: adapters[n] for n in names}, max_num_seqs=args.requests,
                          max_lora_rank=args.rank, max_model_len=1024)
    prompts = random_prompts(args.requests, args.prompt_len, PROMPT_VOCAB, seed=7)
    with served(config, log) as target:
        asyncio.run(_loraplex_round(target, prompts[:2], [None, None], 4))  # warm-up
        chosen = [None if a is None else names[a]
                  for a in request_adapters(args.requests, n_adapters)]
        start = time.perf_counter()
        count = asyncio.run(_loraplex_round(target, prompts, chosen, args.new_tokens))
        return count / (time.perf_counter() - start)


async def _loraplex_round(target: str, prompts: list[list[int]], adapters: list[str | None],
                          new_tokens: int) -> int:
    from ..client import AsyncClient

    async with AsyncClient(target) as client:
        async def one(prompt: list[int], adapter: str | None) -> int:
            tokens = 0
            async for chunk in client.generate_stream(
                    prompt_token_ids=prompt, adapter=adapter or "", temperature=0.0,
                    max_new_tokens=new_tokens, ignore_eos=True):
                tokens += len(chunk.token_ids)
            return tokens

        return sum(await asyncio.gather(*(one(p, a) for p, a in zip(prompts, adapters))))


def in_child(args: argparse.Namespace, what: dict) -> float:
    """One loraplex measurement in a fresh interpreter (no state shared with the others)."""
    argv = [sys.executable, "-m", "loraplex.benchmarks.llamacpp_compare",
            "--llama-cpp", str(args.llama_cpp), "--work", str(args.work),
            "--child", json.dumps(what)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return float(out.split("RESULT ")[-1])


def run_child(what: dict) -> None:
    if what["kind"] == "decode":
        tps = loraplex_decode_tps(what["model"], what["quantization"], what["new_tokens"])
    else:
        raise ValueError(what)
    print(f"RESULT {tps}")


# --- the run -------------------------------------------------------------------------------

def measure(args: argparse.Namespace) -> list[Row]:
    from .llamacpp_models import LlamaCppTools, ensure_files

    tools = LlamaCppTools(args.llama_cpp, args.convert_python)
    files = ensure_files(args.work, tools, args.adapters, args.rank)
    gguf = files.ggufs[args.quant]
    rows: list[Row] = []
    log = args.work / "servers.log"
    twice = 2 if args.both_orders else 1
    if "single" in args.only:
        base = [llama_bench_tg(tools.binary("llama-bench"), gguf, args.single_new_tokens,
                               args.threads)]
        ours = in_child(args, {"kind": "decode", "model": str(gguf), "quantization": "none",
                               "new_tokens": args.single_new_tokens})
        if twice == 2:
            base.append(llama_bench_tg(tools.binary("llama-bench"), gguf,
                                       args.single_new_tokens, args.threads))
        _note("single", base, ours)
        rows.append(Row("single", f"decode, batch 1, {args.quant} .gguf, tg"
                        f"{args.single_new_tokens}", "llama-bench", statistics.mean(base), ours))
    for step, n in (("base", 0), ("mixed", args.adapters)):
        if step not in args.only:
            continue
        loras = [files.adapter_ggufs[k] for k in list(files.adapter_ggufs)[:n]]
        base = [llama_server_tps(tools.binary("llama-server"), gguf, loras, args, n, log)]
        ours = loraplex_server_tps(gguf, files.adapters, args, n, log)
        if twice == 2:
            base.append(llama_server_tps(tools.binary("llama-server"), gguf, loras, args, n,
                                         log))
        _note(step, base, ours)
        what = f"{args.requests} concurrent x {args.prompt_len}+{args.new_tokens}, {args.quant}"
        what += f", {n} adapters mixed" if n else ", base"
        rows.append(Row(step, what, "llama-server", statistics.mean(base), ours))
    if "int4" in args.only:
        decode = {"kind": "decode", "model": str(files.model_dir),
                  "new_tokens": args.single_new_tokens}
        bf16 = [in_child(args, {**decode, "quantization": "none"})]
        int4 = in_child(args, {**decode, "quantization": "int4"})
        if twice == 2:
            bf16.append(in_child(args, {**decode, "quantization": "none"}))
        _note("int4", bf16, int4)
        rows.append(Row("int4", "decode, batch 1, HF dir, --quantization int4 vs none",
                        "loraplex bf16", statistics.mean(bf16), int4))
    return rows


def _note(step: str, baseline: list[float], ours: float) -> None:
    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"  {step}: baseline {' '.join(f'{v:.2f}' for v in baseline)} tok/s, "
          f"loraplex {ours:.2f} tok/s (load average after: {load})", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        run_child(json.loads(args.child))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    from .lora_overhead import resolve_dtype

    machine = machine_line("cpu", f"loraplex dtype {resolve_dtype('auto')} (--dtype auto)")
    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
    print(machine + f"; llama.cpp threads {args.threads}; load average {load} "
          f"on {os.cpu_count()} CPUs", flush=True)
    rows = measure(args)
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "cpus": os.cpu_count(),
            "load_average_at_end": os.getloadavg(), "args": {
            k: str(v) for k, v in vars(args).items()},
            "rows": [{**asdict(r), "ratio": r.ratio, "target": TARGETS[r.step], "met": r.met}
                     for r in rows]}, indent=2))


if __name__ == "__main__":
    main()
