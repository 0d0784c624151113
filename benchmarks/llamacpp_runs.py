"""llama.cpp's side of the comparison (llamacpp_compare.py): ``llama-bench``'s decode and a
fresh ``llama-server``'s output tok/s under concurrent requests, with its request bodies.

llama-server's LoRA traps: a request without a ``lora`` field runs with every loaded adapter
applied, so every request here names every adapter, at scale 0 but for its own (a base
request: all at 0)."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .common import random_prompts

PROMPT_VOCAB = 49152  # the SmolLM2 tokenizer's real tokens (the rest are [PAD] fillers)


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


def llama_bench_tg(bench: Path, gguf: Path, new_tokens: int, threads: int) -> float:
    """llama-bench's tg<new_tokens> on ``gguf`` (mean tok/s of its 2 repetitions)."""
    out = subprocess.run([str(bench), "-m", str(gguf), "-p", "0", "-n", str(new_tokens),
                          "-t", str(threads), "-r", "2", "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def llama_server_tps(server: Path, gguf: Path, lora_ggufs: list[Path], *, requests: int,
                     prompt_len: int, new_tokens: int, threads: int, n_adapters: int,
                     log: Path) -> float:
    """Output tok/s of ``requests`` concurrent requests (request i on adapter i mod
    ``n_adapters``) to a fresh ``llama-server -np requests`` (continuous batching)."""
    from .server_process import free_port

    port = free_port()
    per_seq = prompt_len + new_tokens + 16
    cmd = [str(server), "-m", str(gguf), "-np", str(requests), "-c", str(per_seq * requests),
           "-t", str(threads), "-cb", "--port", str(port), "--host", "127.0.0.1",
           "--no-warmup"]
    for lora in lora_ggufs:
        cmd += ["--lora", str(lora)]
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_health(url, proc)
        prompts = random_prompts(requests, prompt_len, PROMPT_VOCAB, seed=7)
        bodies = [completion_body(p, new_tokens, len(lora_ggufs), a)
                  for p, a in zip(prompts, request_adapters(requests, n_adapters))]
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
