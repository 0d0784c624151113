"""loraplex on Ray Serve: two tiny-model replicas behind Ray's gRPC proxy, driven with the
real loraplex.client. Outputs equal transformers + PEFT; status codes, tokens and health are
the single server's; adapter affinity; cluster-wide hot load / unload; cancellation and
deadlines. The tests share the package's deployment and run in file order (affinity
before the overload test: Ray's router avoids a replica it last saw full for a while
after); the faults that replace a replica come after, in test_ray_serve_faults.py."""

from __future__ import annotations

import asyncio
import collections
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from loraplex.client import AsyncClient, Client
from loraplex.proto import loraplex_pb2 as pb

from tests.server.ray_serve.conftest import ADMIN, NAMES, PROMPTS, N, raw_generate, replica_ids
from tests.server.ray_serve.conftest import REPLICA as TRAILER


def spread(target: str, adapter: str, ids: list[int], n: int = 24) -> list[tuple[Any, str]]:
    """``n`` concurrent raw_generate calls: Ray spreads them over the replicas."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda _: raw_generate(target, adapter, ids), range(n)))


# ---- serving ----------------------------------------------------------------------------
def test_health_serving_and_reflection(client: Client, ray_app: Any) -> None:
    assert client.health() == "SERVING"
    assert client.health("loraplex.v1.Inference") == "SERVING"
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(ray_app.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]), timeout=10)
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"loraplex.v1.Inference", "loraplex.v1.AdapterAdmin",
            "grpc.health.v1.Health"} <= names


def test_every_adapter_equals_peft_unary_and_stream(client: Client, peft_reference) -> None:
    for i, name in enumerate(["", *NAMES]):
        ids = PROMPTS[i % len(PROMPTS)]
        expected = peft_reference(name or None, ids, N)
        reply, trailers = client.generate_with_trailers(
            prompt_token_ids=ids, adapter=name, temperature=0.0, max_new_tokens=N,
            ignore_eos=True)
        assert list(reply.token_ids) == expected, name
        assert trailers.get(TRAILER), trailers
        call = client.generate_stream(prompt_token_ids=ids, adapter=name, temperature=0.0,
                                      max_new_tokens=N, ignore_eos=True)
        chunks = list(call)
        assert [t for c in chunks for t in c.token_ids] == expected, name
        assert len(chunks) > 1 and chunks[-1].finished  # streamed, not one message
        assert dict(call.trailing_metadata()).get(TRAILER)
    assert peft_reference("a0", PROMPTS[1], N) != peft_reference(None, PROMPTS[1], N)


def test_status_codes_through_the_proxy(client: Client, ray_app: Any, tiny_adapters,
                                        tmp_path) -> None:
    def code_of(fn, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as info:
            fn(*args, **kwargs)
        return info.value.code(), info.value.details()

    code, why = code_of(client.generate, adapter="a0", max_new_tokens=2)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "no prompt" in why
    code, why = code_of(client.generate, prompt_token_ids=[1, 2], adapter="nope")
    assert code == grpc.StatusCode.NOT_FOUND and "nope" in why
    code, why = code_of(client.load_adapter, "a0", tiny_adapters("a1"))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "a0" in why
    code, why = code_of(client.load_adapter, "outside", tmp_path)
    assert code == grpc.StatusCode.PERMISSION_DENIED, why
    with Client(ray_app.target) as anonymous:  # no admin token
        code, why = code_of(anonymous.load_adapter, "x", tiny_adapters("a1"))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "--admin-token" in why
        # one token set: the API routes need one too (issue 42), health stays open
        code, why = code_of(anonymous.generate, prompt_token_ids=[1, 2], max_new_tokens=1)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "--admin-token" in why
        assert anonymous.health() == "SERVING"
    code, why = code_of(client.unload_adapter, "never-loaded")
    assert code == grpc.StatusCode.NOT_FOUND
    code, why = code_of(list, client.generate_stream(prompt_token_ids=[1, 2], adapter="nope"))
    assert code == grpc.StatusCode.NOT_FOUND and "nope" in why  # a stream's status too


# ---- adapters ---------------------------------------------------------------------------
def test_affinity_20_requests_land_on_the_holder(client: Client, tiny_adapters) -> None:
    # A fresh adapter, so exactly one replica holds it: the earlier tests sent a0..a3 to
    # both replicas, and between two holders Ray rightly picks either.
    client.load_adapter("aff", tiny_adapters("aff"))

    def replica() -> str:
        return client.generate_with_trailers(prompt_token_ids=[3, 4, 5], adapter="aff",
                                             temperature=0.0, max_new_tokens=2)[1][TRAILER]

    holder = replica()
    time.sleep(1.0)  # replicas report what they hold every 0.1 s, through the controller
    landed = collections.Counter(replica() for _ in range(20))
    print(f"\n[ray] affinity: {landed[holder]}/20 on the holder ({dict(landed)})")
    client.unload_adapter("aff")
    assert landed[holder] >= 18, (holder, landed)


def test_list_adapters_per_replica(client: Client) -> None:
    infos = {i.name: i for i in client.list_adapters()}
    assert set(NAMES) <= set(infos)
    for name in NAMES:
        replicas = infos[name].replicas
        assert len(replicas) == 2, infos[name]
        assert all(pb.AdapterInfo.State.Name(r.state) in ("ON_DISK", "ON_CPU", "ON_DEVICE")
                   for r in replicas)
    assert len(replica_ids(client)) == 2


def test_list_adapters_state_is_the_best_tier_of_any_replica(client: Client,
                                                              tiny_adapters) -> None:
    # issue 28: the top-level state said ON_DISK right after the adapter served
    client.load_adapter("tiers", tiny_adapters("tiers"))
    try:
        holder = client.generate_with_trailers(prompt_token_ids=[3, 4, 5], adapter="tiers",
                                               temperature=0.0, max_new_tokens=2)[1][TRAILER]
        info = {i.name: i for i in client.list_adapters()}["tiers"]
        per_replica = {r.replica: pb.AdapterInfo.State.Name(r.state) for r in info.replicas}
        assert per_replica[holder] in ("ON_CPU", "ON_DEVICE"), per_replica
        order = ["FAILED", "ON_DISK", "LOADING", "ON_CPU", "ON_DEVICE"]
        best = max(per_replica.values(), key=order.index)
        assert pb.AdapterInfo.State.Name(info.state) == best, (info.state, per_replica)
    finally:
        client.unload_adapter("tiers")


def test_load_reaches_every_replica_at_once_unload_too(client: Client, ray_app: Any,
                                                        tiny_adapters, peft_reference
                                                        ) -> None:
    client.load_adapter("hot", tiny_adapters("hot"))
    ids = PROMPTS[1]
    expected = peft_reference("hot", ids, N)
    seen = set()
    for reply, replica in spread(ray_app.target, "hot", ids):  # at once, no retry
        assert not isinstance(reply, grpc.RpcError), reply
        assert list(reply.token_ids) == expected
        seen.add(replica)
    assert len(seen) == 2, seen  # spread over both replicas
    client.unload_adapter("hot")
    seen = set()
    for reply, replica in spread(ray_app.target, "hot", ids):
        assert isinstance(reply, grpc.RpcError) and \
            reply.code() == grpc.StatusCode.NOT_FOUND, reply
        seen.add(replica)
    assert len(seen) == 2, seen
    assert "hot" not in {i.name for i in client.list_adapters()}


def test_replace_reaches_every_replica(client: Client, ray_app: Any, tiny_adapters,
                                       peft_reference) -> None:
    client.load_adapter("swap", tiny_adapters("old"))
    client.load_adapter("swap", tiny_adapters("new"), replace=True)
    ids = PROMPTS[0]
    for _ in range(8):
        reply, _ = raw_generate(ray_app.target, "swap", ids)
        assert list(reply.token_ids) == peft_reference("new", ids, N)


def test_queue_full_is_resource_exhausted(ray_app: Any) -> None:
    """More streams at once than 2 replicas x --max-queue (Ray sends a replica up to
    max_queue + 8 calls): each one completes, or gets the single server's
    RESOURCE_EXHAUSTED."""
    async def one(c: AsyncClient) -> str:
        n = 0
        try:
            async for chunk in c.generate_stream(prompt_token_ids=[5, 6, 7], temperature=0.0,
                                                 max_new_tokens=240, ignore_eos=True):
                n += len(chunk.token_ids)
            return "OK" if n == 240 else f"SHORT {n}"
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}"

    async def run() -> list[str]:
        async with AsyncClient(ray_app.target, admin_token=ADMIN) as c:
            return await asyncio.gather(*(one(c) for _ in range(7 * ray_app.options.max_queue)))

    outcomes = collections.Counter(o.split(":")[0] for o in asyncio.run(run()))
    print(f"\n[ray] {7 * ray_app.options.max_queue} concurrent streams: {dict(outcomes)}")
    assert set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED"}, outcomes
    assert outcomes["RESOURCE_EXHAUSTED"] and outcomes["OK"] >= ray_app.options.max_queue


# ---- cancellation, deadlines ------------------------------------------------------------
def idle(client: Client) -> bool:
    s = client.stats()
    return (s.num_running, s.num_waiting, s.num_in_flight) == (0, 0, 0)


def test_cancel_and_deadline_reach_the_engine(client: Client) -> None:
    call = client.generate_stream(prompt_token_ids=[9, 9, 9], temperature=0.0,
                                  max_new_tokens=240, ignore_eos=True)
    next(call)
    call.cancel()
    # the deadline: a quarter of what the same request takes whole here, so that it expires
    # mid-request however fast or loaded the machine is (a fixed 0.3 s was past a quiet
    # machine's whole request)
    started = time.monotonic()
    list(client.generate_stream(prompt_token_ids=[8, 8, 8], temperature=0.0,
                                max_new_tokens=240, ignore_eos=True))
    deadline_s = max(0.02, (time.monotonic() - started) / 4)
    with pytest.raises(grpc.RpcError) as info:
        for _ in client.generate_stream(prompt_token_ids=[8, 8, 8], temperature=0.0,
                                        max_new_tokens=240, ignore_eos=True,
                                        timeout=deadline_s):
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while not idle(client):
        assert time.monotonic() < deadline, client.stats()
        time.sleep(0.1)
    assert client.stats().kv_blocks_used == 0
