"""A real local Ray cluster (4 logical CPUs, no dashboard) and one deployment of two tiny-model
replicas behind Ray Serve's gRPC and HTTP proxies, shared by the package's modules (the HTTP
tests run first, the fault tests last); start-up time and memory are printed in the test log
(run pytest with -s to see them, or read the -ra summary)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

ADMIN = "adm"
# the deployment's only token: every route but health and /metrics needs it (issue 42)
AUTH = (("authorization", f"Bearer {ADMIN}"),)
NAMES = ["a0", "a1", "a2", "a3"]
PROMPTS = [[10, 20, 30], [40, 41, 42, 43, 44], [7, 8], [100, 101, 102, 103]]
N = 10  # new tokens per request
REPLICA = "loraplex-replica"  # the trailer (gRPC) and header (HTTP) naming the replica
ENGINE_KW = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "max_num_seqs": 32,
             "max_num_batched_tokens": 256, "max_loras": 2, "max_cpu_loras": 4}
MAX_QUEUE = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_memory_gib() -> float:
    """Resident memory of every Ray process on this machine (raylet, GCS, workers, replicas)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"ray" not in cmd or pid == str(os.getpid()):
                continue
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total / 2**30


@dataclass
class RayApp:
    target: str
    http_url: str
    options: Any  # ServerOptions
    ray_options: Any  # RayOptions
    adapters: dict[str, str]


@pytest.fixture(scope="package")
def ray_app(tiny_llama: Path, tiny_adapters: Callable[[str], Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayApp]:
    import ray
    from loraplex.engine.engine_config import EngineConfig
    from loraplex.server.ray.launch import RayOptions, deploy, start_ray, teardown
    from loraplex.server.server_options import ServerOptions

    modules = {n: str(tiny_adapters(n)) for n in NAMES}
    options = ServerOptions(port=_free_port(), http_port=_free_port(), admin_token=ADMIN,
                            max_queue=MAX_QUEUE,
                            adapter_roots=[tiny_adapters("a0").parent], shutdown_grace_s=1.0,
                            upload_dir=tmp_path_factory.mktemp("ray_uploads"))
    ray_options = RayOptions(num_replicas=2, replica_cpus=1, num_cpus=4,
                             health_check_period_s=1.0)
    took = start_ray(ray_options)
    print(f"\n[ray] ray.init(num_cpus=4, include_dashboard=False): {took:.1f}s, "
          f"{ray_memory_gib():.2f} GiB")
    start = time.perf_counter()
    try:
        deploy(options, ray_options,
               EngineConfig(model=str(tiny_llama), lora_modules=modules, **ENGINE_KW))
        print(f"[ray] serve.run of 2 replicas: {time.perf_counter() - start:.1f}s; Ray "
              f"processes now hold {ray_memory_gib():.2f} GiB")
        yield RayApp(f"127.0.0.1:{options.port}", f"http://127.0.0.1:{options.http_port}",
                     options, ray_options, modules)
    finally:
        teardown(ray_options)
        assert not ray.is_initialized()


@pytest.fixture(scope="session")
def peft_reference(tiny_llama: Path, tiny_adapters: Callable[[str], Path]
                   ) -> Callable[[str | None, list[int], int], list[int]]:
    """peft_reference(adapter or None, prompt ids, n) -> transformers (+ PEFT) greedy ids,
    no EOS stop."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cache: dict[tuple, list[int]] = {}

    def get(name: str | None, ids: list[int], n: int) -> list[int]:
        key = (name, tuple(ids), n)
        if key not in cache:
            model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
            if name is not None:
                model = PeftModel.from_pretrained(model, tiny_adapters(name))
            seq = torch.tensor([ids])
            with torch.no_grad():
                for _ in range(n):
                    nxt = model.eval()(seq).logits[0, -1].argmax()
                    seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
            cache[key] = seq[0, len(ids):].tolist()
        return cache[key]

    return get


@pytest.fixture(scope="module")
def client(ray_app: RayApp) -> Iterator[Any]:
    """loraplex.client through Ray's gRPC proxy, with the admin token; SERVING first."""
    from loraplex.client import Client

    with Client(ray_app.target, admin_token=ADMIN) as c:
        c.wait_until_serving(60)
        yield c


def replica_ids(client: Any) -> set[str]:
    """Every replica the registry's adapters are held on (ListAdapters)."""
    return {r.replica for info in client.list_adapters() for r in info.replicas}


def raw_generate(target: str, adapter: str, ids: list[int], n: int = N
                 ) -> tuple[Any, str]:
    """One Generate without the multiplexed_model_id metadata (as grpcurl sends it): Ray
    routes it to any replica. (reply or grpc.RpcError, replica id from the trailer)."""
    import grpc
    from loraplex.proto import loraplex_pb2 as pb
    from loraplex.proto import loraplex_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        request = pb.GenerateRequest(adapter=adapter, prompt_token_ids=ids, params=pb.SamplingParams(
            temperature=0.0, max_new_tokens=n, ignore_eos=True))
        try:
            reply, call = stub.Generate.with_call(request, timeout=60, metadata=AUTH)
            return reply, dict(call.trailing_metadata())[REPLICA]
        except grpc.RpcError as e:
            return e, dict(e.trailing_metadata() or ()).get(REPLICA, "")
