"""In-place adapter swaps as a training loop drives them, against a ``loraplex serve``
subprocess on the embedded SmolLM2-135M:

    python -m loraplex.benchmarks.adapter_swap [--swaps 20] [--uploads 10] [--seconds 10]
                                          [--blocks 2]

- **swap**: ``LoadAdapter(replace=True)`` of a rank-16 all-linear adapter (float32 file)
  over the resident, idle previous version: request to answer, p50 / p90 (target p50
  <= 50 ms);
- **upload**: ``UploadAdapter`` of the same adapter saved in bf16, in place: request to
  answer, p50 / p90 (target <= 250 ms for about 8 MB);
- **throughput**: 8 clients sampling the adapter (greedy, 64-token prompts, 32 new tokens)
  for ``--seconds``, with no swap and with an in-place swap every second, in ``--blocks``
  blocks of none, swaps, swaps, none (a state one phase leaves cannot favour either, and a
  slow spell of a shared machine hits both); each block's ratio and the ratio of the
  totals (target >= 0.9).

Prints the machine (ISA, dtype, kernels) and the load average (other work on the machine)
first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..client import Client
from .common import (
    add_engine_flags,
    default_model_dir,
    machine_line,
    make_random_adapters,
    random_prompts,
)
from .server_process import serve_config, served

RANK = 16
CLIENTS = 8
NEW = 32


def bf16_copy(src: Path, dst: Path) -> Path:
    """The adapter with its tensors in bf16 (the file a bf16 trainer writes)."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "adapter_config.json").write_bytes((src / "adapter_config.json").read_bytes())
    tensors = {k: v.to(torch.bfloat16) for k, v in
               load_file(src / "adapter_model.safetensors").items()}
    save_file(tensors, dst / "adapter_model.safetensors", metadata={"format": "pt"})
    return dst


def quantiles(ms: list[float]) -> str:
    q = statistics.quantiles(ms, n=10)
    return f"p50 {statistics.median(ms):.1f} ms, p90 {q[-1]:.1f} ms (n={len(ms)})"


def time_calls(call, n: int) -> list[float]:
    out = []
    for i in range(n):
        start = time.perf_counter()
        call(i)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def sample_phase(target: str, seconds: float, swap: list[Path] | None) -> float:
    """Tokens per second of CLIENTS greedy streams; with ``swap``, an in-place load of
    the next of its versions every second."""
    stop = threading.Event()
    counts = [0] * CLIENTS
    prompts = random_prompts(CLIENTS * 64, 64, 49152, seed=int(time.time()))

    def client(k: int) -> None:
        with Client(target) as c:
            i = k
            while not stop.is_set():
                out = c.generate(prompt_token_ids=prompts[i % len(prompts)], adapter="policy",
                                 temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
                counts[k] += len(out.token_ids)
                i += CLIENTS

    def swapper() -> None:
        with Client(target) as c:
            i = 0
            while not stop.wait(1.0):
                c.load_adapter("policy", str(swap[i % len(swap)]), replace=True)
                i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
    if swap:
        threads.append(threading.Thread(target=swapper))
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg()) + " (1, 5, 15 min)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--swaps", type=int, default=20)
    ap.add_argument("--uploads", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=10.0, help="per throughput phase")
    ap.add_argument("--blocks", type=int, default=2, help="none/swaps/swaps/none blocks")
    add_engine_flags(ap, "dtype")
    args = ap.parse_args()
    model = default_model_dir()
    root = Path(tempfile.mkdtemp(prefix="loraplex-adapter-swap-"))
    versions = list(make_random_adapters(model, 3, root, rank=RANK).values())
    upload = bf16_copy(versions[0], root / "bf16")
    mb = (upload / "adapter_model.safetensors").stat().st_size / 1e6
    config = serve_config(model, {"policy": versions[0]}, dtype=args.dtype,
                          max_num_seqs=CLIENTS,  # every client's request in one batch
                          max_lora_rank=RANK)  # the adapters': no unused rank rows
    with served(config, root / "serve.log") as target, Client(target) as c:
        info = c.server_info()
        print(machine_line("cpu (server)", f"server dtype {info.dtype}"))
        print(f"load average at start: {_load()}")
        print(f"SmolLM2-135M, rank-{RANK} adapter on all 7 linears "
              f"({(versions[0] / 'adapter_model.safetensors').stat().st_size / 1e6:.1f} MB "
              f"float32 file; {mb:.1f} MB bf16 upload)\n")
        c.generate(prompt_token_ids=[1, 2, 3], adapter="policy", max_new_tokens=1)  # resident
        swaps = time_calls(lambda i: c.load_adapter(
            "policy", str(versions[1 + i % 2]), replace=True), args.swaps)
        print(f"in-place swap (LoadAdapter replace, idle, resident): {quantiles(swaps)}")
        ups = time_calls(lambda i: c.upload_adapter("policy", upload, replace=True),
                         args.uploads)
        print(f"upload ({mb:.1f} MB, in place): {quantiles(ups)}")
        sample_phase(target, min(5.0, args.seconds), None)  # warm-up: not counted
        phases = [("none", None), ("swaps", versions), ("swaps", versions), ("none", None)]
        tps: dict[str, list[float]] = {"none": [], "swaps": []}
        for block in range(args.blocks):
            got = {"none": 0.0, "swaps": 0.0}
            for name, swap in phases:
                rate = sample_phase(target, args.seconds, swap)
                tps[name].append(rate)
                got[name] += rate
                print(f"throughput, block {block + 1}, {name:5s}: {rate:.1f} tokens/s")
            print(f"block {block + 1}: swaps / none {got['swaps'] / got['none']:.3f}x")
        ratio = statistics.mean(tps["swaps"]) / statistics.mean(tps["none"])
        print(f"throughput with a swap every second / none: {ratio:.3f}x (all blocks)")
        print(f"load average at end: {_load()}")
        print(f"versions served: {c.list_adapters()[0].version}")


if __name__ == "__main__":
    main()
