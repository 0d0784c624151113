"""``loraplex serve --ray --min-replicas 1 --max-replicas 2`` under load: Ray's autoscaler
adds the second replica (after Serve's default upscale delay, ~30 s), which comes up with
every registered adapter, the one hot-loaded before it started included, and serves it
exactly. Marked slow (~80 s): run with ``pytest -m slow tests/test_ray_autoscaling.py``."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from loraplex.client import Client
from loraplex.proto import loraplex_pb2 as pb

from tests.conftest import make_adapter
from tests.server.ray_serve.conftest import replica_ids
from tests.server.ray_serve.test_ray_serve import raw_generate
from tests.test_ray_serve_process import free_port, kill_leftovers, popen_serve_ray


def generate(target: str, adapter: str, n: int) -> tuple[list[int], str]:
    """test_ray_serve's raw_generate (no multiplexing metadata: Ray picks any replica) of a
    fixed prompt, which must succeed: (token ids, replica)."""
    reply, replica = raw_generate(target, adapter, [5, 6, 7], n)
    assert not isinstance(reply, grpc.RpcError), reply
    return list(reply.token_ids), replica


@pytest.mark.slow
def test_a_replica_added_by_autoscaling_serves_every_adapter(tiny_llama: Path,
                                                             tmp_path: Path) -> None:
    launch = make_adapter(tiny_llama, tmp_path / "a", seed=3)
    hot = make_adapter(tiny_llama, tmp_path / "hot", seed=4)
    port = free_port()
    log = tmp_path / "serve.log"
    # --adapter-root: Ray's gRPC proxy listens on every interface, so a runtime load by path
    # needs a root (issue 42)
    proc = popen_serve_ray(tiny_llama, launch, port, log, "--adapter-root", str(tmp_path),
                           "--min-replicas", "1",
                           "--max-replicas", "2", "--replica-cpus", "1", "--max-num-seqs", "2",
                           "--max-model-len", "256")
    target = f"127.0.0.1:{port}"
    try:
        with Client(target) as client:
            client.wait_until_serving(180)
            assert len(replica_ids(client)) == 1
            client.load_adapter("hot", hot)  # before the second replica exists
            expected = {name: generate(target, name, 8)[0] for name in ("a", "hot")}

            stop = threading.Event()

            def load() -> None:  # 8 requests in flight; Serve's target is 2 per replica
                while not stop.is_set():
                    generate(target, "a", 120)

            workers = [threading.Thread(target=load, daemon=True) for _ in range(8)]
            for w in workers:
                w.start()
            start = time.monotonic()
            while len(replica_ids(client)) < 2:
                assert time.monotonic() - start < 150, log.read_text()[-3000:]
                time.sleep(1.0)
            took = time.monotonic() - start
            print(f"\n[ray] autoscaling added the second replica after {took:.0f}s of load")
            stop.set()
            for w in workers:
                w.join(130)

            tiers = {i.name: {r.replica: r.state for r in i.replicas}
                     for i in client.list_adapters()}
            assert set(tiers["hot"]) == set(tiers["a"]) == replica_ids(client), tiers
            unheld = {pb.AdapterInfo.FAILED, pb.AdapterInfo.STATE_UNSPECIFIED}
            assert not unheld & {s for held in tiers.values() for s in held.values()}, tiers
            seen: set[str] = set()
            for _ in range(40):  # without metadata Ray spreads them: both replicas answer
                for name in ("hot", "a"):
                    ids, replica = generate(target, name, 8)
                    assert ids == expected[name], (name, replica)
                    seen.add(replica)
                if len(seen) == 2:
                    break
            assert len(seen) == 2, seen
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    finally:
        kill_leftovers(proc)
