"""Start-up, draining, shutdown and engine death: health and status codes in each phase,
and (test_http_lifecycle.py) `loraplex serve` in a subprocess stopped by SIGTERM while a
stream runs."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest
from loraplex.server.state import Phase

from tests.server.conftest import wait_until


def error_of(fn, *args: Any, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    return info.value


def test_not_serving_and_unavailable_while_loading(serve, make_engine, tiny_llama) -> None:
    release = threading.Event()

    def slow_engine() -> Any:
        assert release.wait(30)
        return make_engine(tiny_llama)

    server = serve(slow_engine, load=False)
    loading = server.submit(server.server.load())
    with server.client() as client:
        assert client.health() == "NOT_SERVING"
        err = error_of(client.generate, "the cat", max_new_tokens=2)
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "starting" in err.details()
        assert error_of(client.server_info).code() == grpc.StatusCode.UNAVAILABLE
        release.set()
        loading.result(30)
        assert client.health() == "SERVING"
        assert client.generate("the cat", max_new_tokens=2).usage.completion_tokens == 2


def test_draining_phase_refuses_new_calls(serve, make_engine, tiny_llama) -> None:
    server = serve(lambda: make_engine(tiny_llama))
    state = server.server.state
    with server.client() as client:
        server.call(state.set_phase(Phase.DRAINING))
        assert client.health() == "NOT_SERVING"
        for method in (client.generate, lambda *a, **k: list(client.generate_stream(*a, **k))):
            err = error_of(method, "the cat", max_new_tokens=2)
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in err.details()
        assert client.stats().num_in_flight == 0  # info and stats still answer
        server.call(state.set_phase(Phase.SERVING))
        assert client.health() == "SERVING"


def test_stop_lets_in_flight_stream_finish(serve, make_engine, tiny_llama) -> None:
    server = serve(lambda: make_engine(tiny_llama))
    with server.client() as client:
        call = client.generate_stream("the cat", max_new_tokens=120, ignore_eos=True)
        chunks = [next(call)]
        stopping = server.submit(server.server.stop(grace=20))
        wait_until(lambda: server.server.state.phase is Phase.DRAINING, what="DRAINING")
        chunks += list(call)
        assert chunks[-1].finished and chunks[-1].finish_reason == "length"
        assert sum(len(c.token_ids) for c in chunks) == 120
        stopping.result(20)
        server.stopped = True
        assert error_of(client.health, timeout=2.0).code() == grpc.StatusCode.UNAVAILABLE


def test_stop_cancels_what_outlives_the_grace_period(serve, make_engine, tiny_llama) -> None:
    server = serve(lambda: make_engine(tiny_llama))
    with server.client() as client:
        call = client.generate_stream("the cat", max_new_tokens=240, ignore_eos=True)
        next(call)
        started = time.monotonic()
        server.call(server.server.stop(grace=0.1))
        server.stopped = True
        assert time.monotonic() - started < 5.0
        with pytest.raises(grpc.RpcError):
            list(call)
        assert not server.server.state.engine.alive


def test_engine_death_turns_health_not_serving(serve, make_engine, tiny_llama) -> None:
    server = serve(lambda: make_engine(tiny_llama))

    def broken_step() -> list:
        raise RuntimeError("simulated device fault")

    server.engine.step = broken_step
    with server.client() as client:
        err = error_of(client.generate, "the cat", max_new_tokens=2)
        assert err.code() == grpc.StatusCode.INTERNAL and "simulated" in err.details()
        wait_until(lambda: client.health() == "NOT_SERVING", what="NOT_SERVING")
        err = error_of(client.generate, "the cat", max_new_tokens=2)
        assert err.code() == grpc.StatusCode.INTERNAL and "restarted" in err.details()


# `loraplex serve` in a subprocess, stopped by SIGTERM while a gRPC stream runs (it finishes
# the stream, exits 0, logged its capacity): tests/server/test_http_lifecycle.py's
# test_cli_serve_drains_both_fronts_on_sigterm, one process with an HTTP stream beside it.
