"""``python -m loraplex.benchmarks.memory``: the resident memory of ``loraplex serve`` as
``make serve`` runs it (the embedded model and the demo adapters), after answering the
README's four requests, and of ``serve --ray --num-replicas 2`` with Ray included.
``--quantization auto none`` measures plain serve once per value, in that order (the
default, auto, serves the embedded model's own Q4_1 / Q8_0 weights; none, its float32
conversion); each report gives the seconds from launch to SERVING (start-up).

Each server runs as a subprocess; its memory is summed over its whole process tree (for
``--ray``: the driver, Ray's GCS, raylet, dashboard and agents, and the replicas' workers,
all descendants of the ``serve`` process). RSS counts a page shared by two processes (a
library, a copy-on-write page) in both; PSS splits it between them, so the PSS sum is the
memory the tree really holds. The targets (issue 28) are on the RSS sum.

Prints the machine, the figures and GetServerInfo's reserved / committed pool memory;
``--out`` writes the same text as a Markdown file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..client import Client
from ..config import ServeConfig
from ..config_flags import to_argv
from ..engine.engine_config import QUANTIZATIONS, EngineConfig
from ..server.ray.ray_options import RayOptions
from .server_process import free_port

QUESTION = "What is the capital of France?"
ADAPTERS = ("", "caps", "json", "pirate")  # the README's four requests: base, then each
TARGETS = {"serve": 1.5 * 2**30, "serve --ray --num-replicas 2": 5 * 2**30}
START_TIMEOUT_S = 900
SETTLE_S = 3.0  # after the answers, before reading memory (the loop's last step ends)


@dataclass(frozen=True)
class TreeMemory:
    processes: int
    rss: int  # bytes, summed over the tree
    pss: int

    def row(self) -> str:
        return f"{_gib(self.rss)} | {_gib(self.pss)} | {self.processes}"


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (from /proc's parent ids)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def _field_kib(path: Path, name: str) -> int:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_memory(root: int) -> TreeMemory:
    pids = descendants(root)
    rss = sum(_field_kib(Path(f"/proc/{p}/status"), "VmRSS") for p in pids)
    pss = sum(_field_kib(Path(f"/proc/{p}/smaps_rollup"), "Pss") for p in pids)
    return TreeMemory(len(pids), rss, pss)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def measure(name: str, config: ServeConfig, log_path: Path, python: str) -> list[str]:
    """Start ``loraplex serve`` with ``config`` (under ``python``; its ports: free ones),
    read its memory once SERVING, ask the four questions, read it again; the report's
    lines."""
    port = free_port()
    served = dataclasses.replace(config, server=dataclasses.replace(
        config.server, host="127.0.0.1", port=port, http_port=free_port()))
    cmd = [python, "-m", "loraplex.cli", "serve", *to_argv(served)]
    launched = time.monotonic()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    lines = [f"### `loraplex {' '.join(['serve', *to_argv(config)])}`"
             + ("" if python == sys.executable else f" ({python})"), ""]
    try:
        with Client(f"127.0.0.1:{port}") as client:
            client.wait_until_serving(timeout=START_TIMEOUT_S)
            up = time.monotonic() - launched
            serving = tree_memory(proc.pid)
            answers = [client.generate(QUESTION, adapter=a, apply_chat_template=True,
                                       temperature=0.0, max_new_tokens=64, timeout=300).text
                       for a in ADAPTERS]
            time.sleep(SETTLE_S)
            after = tree_memory(proc.pid)
            info = client.server_info(timeout=30)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    target = TARGETS[name]
    verdict = "meets" if after.rss <= target else "MISSES"
    lines += [
        f"SERVING {up:.1f} s after launch. Answers (greedy): "
        + "; ".join(f"{a or 'base'}: {t.strip()!r}" for a, t in zip(ADAPTERS, answers)), "",
        "| when | RSS (sum) | PSS (sum) | processes |", "| --- | --- | --- | --- |",
        f"| SERVING | {serving.row()} |", f"| after the four requests | {after.row()} |", "",
        f"Target RSS ≤ {_gib(target)}: **{verdict}** ({_gib(after.rss)}).", "",
        _info_line(info), "",
    ]
    return lines


def _info_line(info: Any) -> str:
    head = f"GetServerInfo (one replica): {info.dtype} on {info.device}; max_loras " \
           f"{info.max_loras}; LoRA pool {_mib(info.lora_memory)} reserved"
    if not info.kv_cache_bytes:  # a server from before these fields
        return head + " (no committed figures from this server)."
    return (f"{head}, {_mib(info.lora_memory_committed)} committed; KV cache "
            f"{_mib(info.kv_cache_bytes)} reserved ({info.kv_cache_tokens} tokens), "
            f"{_mib(info.kv_cache_committed)} committed.")


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    total = _field_kib(Path("/proc/meminfo"), "MemTotal")
    return (f"{cpu}, {os.cpu_count()} cores, {_gib(total)} memory; Python "
            f"{platform.python_version()}, torch {torch.__version__}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-ray", action="store_true", help="measure plain serve only")
    p.add_argument("--quantization", nargs="+", default=["auto"], choices=QUANTIZATIONS,
                   help="plain serve's --quantization, one run each in this order")
    p.add_argument("--out", type=Path, help="also write the report here (Markdown)")
    p.add_argument("--server-python", default=sys.executable,
                   help="the Python that runs the servers (another checkout's venv, to "
                        "compare: its own loraplex is served)")
    p.add_argument("--log", type=Path, default=Path("bench-memory-server.log"),
                   help="the servers' output")
    args = p.parse_args(argv)
    # the command's defaults (the embedded model, the demos) but --quantization
    runs = [("serve", ServeConfig(engine=EngineConfig(quantization=q)))
            for q in args.quantization]
    if not args.skip_ray:
        runs.append(("serve --ray --num-replicas 2",
                     ServeConfig(ray=RayOptions(num_replicas=2))))
    lines = ["# Memory of `loraplex serve` (python -m loraplex.benchmarks.memory)", "",
             f"Machine: {machine()}.", ""]
    print("\n".join(lines), flush=True)
    for name, config in runs:
        run = measure(name, config, args.log, args.server_python)
        print("\n".join(run), flush=True)
        lines += run
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
