"""loraplex on Ray Serve: two tiny-model replicas behind Ray's gRPC proxy, driven with the
real loraplex.client. Outputs equal transformers + PEFT; status codes, tokens and health are
the single server's; adapter affinity; cluster-wide hot load / unload; a replica killed
mid-stream. The tests share one deployment and run in file order (affinity before the
overload test: Ray's router avoids a replica it last saw full for a while after)."""

from __future__ import annotations

import asyncio
import collections
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from loraplex.client import AsyncClient, Client
from loraplex.proto import loraplex_pb2 as pb
from loraplex.proto import loraplex_pb2_grpc as pb_grpc

from tests.server.ray_serve.conftest import NAMES, PROMPTS, N, replica_ids
from tests.server.ray_serve.conftest import REPLICA as TRAILER


def raw_generate(target: str, adapter: str, ids: list[int], n: int = N
                 ) -> tuple[pb.GenerateResponse | grpc.RpcError, str]:
    """One Generate without the multiplexed_model_id metadata (as grpcurl sends it): Ray
    routes it to any replica. (reply or error, replica id from the trailer)."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        request = pb.GenerateRequest(adapter=adapter, prompt_token_ids=ids, params=pb.SamplingParams(
            temperature=0.0, max_new_tokens=n, ignore_eos=True))
        try:
            reply, call = stub.Generate.with_call(request, timeout=60)
            return reply, dict(call.trailing_metadata())[TRAILER]
        except grpc.RpcError as e:
            return e, dict(e.trailing_metadata() or ()).get(TRAILER, "")


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
        anonymous.generate(prompt_token_ids=[1, 2], max_new_tokens=1)  # API calls are open
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
        async with AsyncClient(ray_app.target) as c:
            return await asyncio.gather(*(one(c) for _ in range(7 * ray_app.options.max_queue)))

    outcomes = collections.Counter(o.split(":")[0] for o in asyncio.run(run()))
    print(f"\n[ray] {7 * ray_app.options.max_queue} concurrent streams: {dict(outcomes)}")
    assert set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED"}, outcomes
    assert outcomes["RESOURCE_EXHAUSTED"] and outcomes["OK"] >= ray_app.options.max_queue


# ---- cancellation, deadlines, faults --------------------------------------------------------
def idle(client: Client) -> bool:
    s = client.stats()
    return (s.num_running, s.num_waiting, s.num_in_flight) == (0, 0, 0)


def test_cancel_and_deadline_reach_the_engine(client: Client) -> None:
    call = client.generate_stream(prompt_token_ids=[9, 9, 9], temperature=0.0,
                                  max_new_tokens=240, ignore_eos=True)
    next(call)
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        for _ in client.generate_stream(prompt_token_ids=[8, 8, 8], temperature=0.0,
                                        max_new_tokens=240, ignore_eos=True, timeout=0.3):
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while not idle(client):
        assert time.monotonic() < deadline, client.stats()
        time.sleep(0.1)
    assert client.stats().kv_blocks_used == 0


def test_replica_killed_mid_stream(client: Client, ray_app: Any, tiny_adapters,
                                   peft_reference) -> None:
    """The client of a stream on a killed replica gets the tokens sent so far, exact, then
    UNAVAILABLE with Ray's "actor died" message and the dead replica's id as the
    ``loraplex-replica`` trailer. Ray starts a new replica, which serves every registered
    adapter."""
    import ray

    client.load_adapter("late", tiny_adapters("late"))
    before = replica_ids(client)
    victim = min(before)
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if victim in a["name"]]
    assert len(actors) == 1, actors
    ids = PROMPTS[2]
    expected = peft_reference(None, ids, 200)
    streams = []
    for _ in range(10):  # some land on the victim (all on one: p = 2^-9)
        call = client.generate_stream(prompt_token_ids=ids, temperature=0.0,
                                      max_new_tokens=200, ignore_eos=True)
        streams.append((call, list(next(call).token_ids)))
    ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]),
             no_restart=True)
    outcomes = collections.Counter()
    for call, got in streams:
        try:
            for chunk in call:
                got += chunk.token_ids
            outcomes["OK"] += 1
            assert got == expected
        except grpc.RpcError as e:
            outcomes[e.code().name] += 1
            assert "actor" in e.details().lower(), e.details()
            assert dict(e.trailing_metadata())[TRAILER] == victim
            assert got == expected[:len(got)]  # the partial stream, exact
    print(f"\n[ray] streams when a replica is killed: {dict(outcomes)}")
    assert outcomes["OK"] and outcomes["UNAVAILABLE"], outcomes  # the victim's streams failed
    assert set(outcomes) <= {"OK", "UNAVAILABLE"}, outcomes
    deadline = time.monotonic() + 120
    while True:  # Ray replaces the replica; the new one joins with every adapter
        now = replica_ids(client)
        if len(now) == 2 and victim not in now:
            break
        assert time.monotonic() < deadline, now
        time.sleep(1.0)
    assert client.health() == "SERVING"
    infos = {i.name: i for i in client.list_adapters()}
    assert {*NAMES, "late"} <= set(infos)
    assert all(len(infos[n].replicas) == 2 and all(r.state for r in infos[n].replicas)
               for n in (*NAMES, "late"))
    newcomer = (now - before).pop()
    for _ in range(40):  # a request on the new replica, exact
        reply, replica = raw_generate(ray_app.target, "late", PROMPTS[3])
        if replica == newcomer:
            assert list(reply.token_ids) == peft_reference("late", PROMPTS[3], N)
            break
    else:
        pytest.fail("no request reached the new replica")


def serve_controller_log() -> str:
    """What Serve's controller logged in this Ray session (it logs each failed health check)."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    return "".join(p.read_text(errors="replace") for p in sorted(logs.glob("controller_*.log")))


def replica_actor(replica_id: str) -> Any:
    import ray

    actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if replica_id in a["name"]]
    assert len(actors) == 1, actors
    return ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"])


def wait_for_replacement(client: Client, victim: str, timeout_s: float = 90.0) -> set[str]:
    """Two replicas again, none of them ``victim`` (calls that land on the victim while it is
    being replaced may fail: retried)."""
    deadline = time.monotonic() + timeout_s
    now: set[str] = set()
    while True:
        try:
            now = replica_ids(client)
            if len(now) == 2 and victim not in now and client.health() == "SERVING":
                return now
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, now
        time.sleep(0.5)


def _fail_engine_loop(actor: Any, reason: str) -> str:
    """Runs inside a replica's actor (``__ray_call__``): its engine loop raises
    ``RuntimeError(reason)`` on its next turn, as an internal fault would (the loop asks
    ``has_unfinished_requests`` every turn, 50 ms apart when idle). Returns the replica id."""
    replica = actor._replica_impl._user_callable_wrapper.user_callable  # Ray Serve's
    engine = replica.state.require_engine().engine

    def fault() -> bool:
        raise RuntimeError(reason)

    setattr(engine, "has_unfinished_requests", fault)  # noqa: B010 - the instance's
    return replica.replica_id


def test_engine_thread_death_fails_the_health_check(client: Client, ray_app: Any,
                                                    peft_reference) -> None:
    """One replica's engine loop raises (``_fail_engine_loop``, run in its actor) and its
    thread dies: that replica's health check, the method Ray's controller calls, fails
    with the engine's error; the controller logs the failure and replaces the replica; the
    new replica serves every registered adapter, exact."""
    import ray

    registered = {i.name for i in client.list_adapters()}
    before = replica_ids(client)
    target = min(before)
    victim = ray.get(replica_actor(target).__ray_call__.remote(
        _fail_engine_loop, "simulated engine fault"), timeout=30)
    assert victim == target, (victim, before)

    error = None
    for _ in range(100):  # Ray's health check of that replica, once the loop has died
        try:
            ray.get(replica_actor(victim).check_health.remote(), timeout=10)
        except RuntimeError as e:
            error = e
            break
        time.sleep(0.1)
    assert error is not None, "the health check still passes"
    assert "engine loop has stopped" in str(error), error
    assert "simulated engine fault" in str(error), error
    now = wait_for_replacement(client, victim)
    failed = [line for line in serve_controller_log().splitlines()
              if victim in line and "failed health check" in line]
    assert failed, f"Serve's controller logged no failed health check of {victim}"
    print(f"\n[ray] engine thread killed on {victim}: {failed[0].strip()[-120:]}")
    infos = {i.name: i for i in client.list_adapters()}
    assert registered <= set(infos)
    assert all({r.replica for r in infos[n].replicas} == now for n in registered)
    newcomer = (now - before).pop()
    expected = peft_reference("a1", PROMPTS[3], N)
    for _ in range(40):  # a request on the new replica, exact (others too)
        reply, replica = raw_generate(ray_app.target, "a1", PROMPTS[3])
        assert not isinstance(reply, grpc.RpcError), reply
        assert list(reply.token_ids) == expected, replica
        if replica == newcomer:
            break
    else:
        pytest.fail("no request reached the new replica")
