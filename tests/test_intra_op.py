"""Only the engine thread holds an OpenMP pool (kernel_backends/intra_op.py): serving adapters (reads
on loader threads, a read on an asyncio worker, hot loads) leaves the process's thread
counts and torch settings as they were. A pool on a second thread would cut every OpenMP
worker's spin-wait in the process and slow every later step (the regression this guards).

Each check runs in a fresh Python process, so that no other test's threads are counted."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from .conftest import ALL_TARGETS, make_adapter, make_tiny_model

# big enough that an adapter read's float32 conversion runs as a parallel torch op
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
             "num_key_value_heads": 2}

SCRIPT = textwrap.dedent("""
    import asyncio, json, sys, threading
    import torch
    from loraplex import LLMEngine, SamplingParams
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.kernel_backends import intra_op

    model, adapters, hot = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    threads_main = torch.get_num_threads()
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    report = {"found_openmp": intra_op.available(), "threads_main": threads_main}
    at_start = intra_op.openmp_workers()

    async def serve(ae, adapter):
        async for out in ae.generate([5, 6, 7, 8], params, adapter=adapter):
            pass
        return out.token_ids

    async def main():
        ae = await AsyncEngine.build(lambda: LLMEngine(
            model=model, max_loras=2, max_cpu_loras=2, max_lora_rank=32,
            max_adapter_reads=2, lora_modules=adapters))
        ae.start()
        await serve(ae, None)
        report["engine_threads"] = await ae.run(lambda e: torch.get_num_threads())
        warm = intra_op.openmp_workers()
        report["added_by_building_and_stepping"] = warm - at_start
        for _ in range(2):  # more adapters than slots and host places: reads and rereads
            await asyncio.gather(*(serve(ae, name) for name in adapters))
        weights = await asyncio.to_thread(ae.engine.read_adapter, hot, "hot")
        await ae.run(lambda e: e.add_adapter("hot", hot, weights=weights))
        await serve(ae, "hot")
        report["added_by_serving"] = intra_op.openmp_workers() - warm
        report["engine_threads_after"] = await ae.run(lambda e: torch.get_num_threads())
        ae.shutdown()

    asyncio.run(main())
    report["threads_main_after"] = torch.get_num_threads()

    def settle():
        # wait until threads that are ending (executors shut down above) are gone, so
        # that the counts below see only what the measured op starts
        import time
        last, same = intra_op.openmp_workers(), 0
        for _ in range(200):
            time.sleep(0.05)
            now = intra_op.openmp_workers()
            same = same + 1 if now == last else 0
            last = now
            if same >= 10:
                return

    def in_new_thread(fn):
        settle()
        out = {}
        t = threading.Thread(target=lambda: out.update(fn()))
        t.start(); t.join()
        return out

    def big_op():
        before = intra_op.openmp_workers()
        torch.ones(1 << 22).mul_(2.0)
        return {"added": intra_op.openmp_workers() - before}

    def serial_op():
        with intra_op.serial():
            inside = intra_op.thread_parallelism()
            out = big_op()
        return {**out, "inside": inside, "restored": intra_op.thread_parallelism()}

    report["serial"] = in_new_thread(serial_op)
    report["plain"] = in_new_thread(big_op)  # last: it leaves a pool behind
    print(json.dumps(report))
""")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("intra_op")
    model = make_tiny_model(root / "model", "llama", **SHAPE)
    adapters = {f"a{i}": str(make_adapter(model, root / f"a{i}", r=32, seed=i,
                                          target_modules=ALL_TARGETS)) for i in range(4)}
    hot = make_adapter(model, root / "hot", r=16, seed=9, target_modules=ALL_TARGETS)
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(model), json.dumps(adapters),
                          str(hot)], capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_openmp_runtime_is_found(served: dict) -> None:
    assert served["found_openmp"], "kernel_backends/intra_op.py found no OpenMP runtime in torch"


def test_serving_adapters_starts_no_thread_pool(served: dict) -> None:
    assert served["added_by_serving"] == 0, served


def test_the_engine_thread_holds_the_only_pool(served: dict) -> None:
    """Built and stepped on one thread: one pool (its workers), not one per thread."""
    assert served["added_by_building_and_stepping"] == served["threads_main"] - 1, served


def test_thread_counts_are_unchanged_by_serving(served: dict) -> None:
    assert served["threads_main_after"] == served["threads_main"], served
    assert served["engine_threads_after"] == served["engine_threads"] == served["threads_main"]


def test_serial_runs_on_the_calling_thread_and_restores(served: dict) -> None:
    assert served["serial"] == {"added": 0, "inside": 1, "restored": served["threads_main"]}


def test_a_parallel_op_on_a_new_thread_starts_a_pool(served: dict) -> None:
    """The measurement can see the fault: a plain op on a fresh thread adds its workers."""
    assert served["plain"]["added"] == served["threads_main"] - 1, served
