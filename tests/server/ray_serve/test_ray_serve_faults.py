"""loraplex on Ray Serve when a replica fails (after test_ray_serve.py, on the package's
deployment): a replica killed mid-stream, and a replica whose engine thread dies. Each
client sees what it was sent, exact, then a clear status; Ray replaces the replica, and the
new one serves every registered adapter."""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from loraplex.client import Client

from tests.server.ray_serve.conftest import NAMES, PROMPTS, N, raw_generate, replica_ids
from tests.server.ray_serve.conftest import REPLICA as TRAILER


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
