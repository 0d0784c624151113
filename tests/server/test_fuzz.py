"""Property-based fuzzing of GenerateRequest and LoadAdapterRequest against a running server:
every answer is OK or one of the documented statuses (never UNKNOWN or INTERNAL for what a
client sent), an OK answer is well formed, and the server stays SERVING with nothing leaked.

The bounded runs are part of ``make test`` (derandomized, ~40 examples each); the
``slow``-marked ones explore much further: ``pytest -m slow tests/server/test_fuzz.py``.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from loraplex.proto import loraplex_pb2 as pb
from loraplex.proto import loraplex_pb2_grpc as pb_grpc

ALIAS = "tiny-base"
GOOD = "good"
VOCAB = 384
MAX_MODEL_LEN = 48  # keeps every accepted request short
MAX_LORAS = 4
GENERATE_OK = {"OK", "INVALID_ARGUMENT", "NOT_FOUND"}
LOAD_OK = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED"}
FINISH_REASONS = {"stop", "eos", "length"}

OUTCOMES: Counter[str] = Counter()  # "generate:OK", "load:NOT_FOUND", ... over the module

BOUNDED = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow])
LONG = settings(max_examples=600, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


# ---- strategies --------------------------------------------------------------------------
def _mostly(valid: st.SearchStrategy, anything: st.SearchStrategy) -> st.SearchStrategy:
    """Valid values about two times in three, so that accepted requests are explored too."""
    return st.one_of(valid, valid, anything)


any_float = st.floats(allow_nan=True, allow_infinity=True)
uint32 = st.integers(0, 2**32 - 1)
token_ids = _mostly(st.integers(0, VOCAB - 1), st.integers(VOCAB - 2, VOCAB + 2) | uint32)
names = st.sampled_from(["", GOOD, ALIAS, "nope", "x" * 129]) | st.text(max_size=40)


@st.composite
def sampling_params(draw: st.DrawFn) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        min_new_tokens=draw(_mostly(st.just(0), st.integers(1, 3) | uint32)),
        stop=draw(st.lists(_mostly(st.sampled_from(["cat", "."]), st.text(max_size=6)),
                           max_size=2)),
        stop_token_ids=draw(st.lists(token_ids, max_size=3)),
        ignore_eos=draw(st.booleans()))
    optional = {
        "temperature": _mostly(st.sampled_from([0.0, 0.7, 1.0, 2.5]), any_float),
        "top_p": _mostly(st.sampled_from([0.1, 0.9, 1.0]), any_float),
        "top_k": _mostly(st.integers(-1, VOCAB + 3), st.integers(-(2**31), 2**31 - 1)),
        "seed": _mostly(st.integers(0, 2**63 - 1), st.integers(2**63 - 2, 2**64 - 1)),
        "max_new_tokens": _mostly(st.integers(1, 8), uint32),
    }
    for name, strategy in optional.items():
        value = draw(st.none() | strategy)
        if value is not None:
            setattr(msg, name, value)
    return msg


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    kind = draw(st.sampled_from(["text", "ids", "text", "ids", "both", "none"]))
    text = draw(_mostly(st.sampled_from(["the cat", "select name from user"]),
                        st.text(max_size=60))) if kind in ("text", "both") else ""
    ids = draw(st.lists(token_ids, min_size=1, max_size=MAX_MODEL_LEN + 4)) \
        if kind in ("ids", "both") else []
    return pb.GenerateRequest(
        request_id=draw(_mostly(st.just(""), st.text(max_size=300))),
        adapter=draw(_mostly(st.sampled_from(["", GOOD, ALIAS]), names)),
        prompt=text, prompt_token_ids=ids, params=draw(sampling_params()),
        apply_chat_template=draw(_mostly(st.just(False), st.booleans())))


@st.composite
def load_requests(draw: st.DrawFn, root: Path) -> pb.LoadAdapterRequest:
    inside = st.sampled_from(["ok", "ok/adapter_config.json", "no-config", "missing",
                              "ok/../..", "ok/./"]).map(lambda p: str(root / p))
    path = draw(inside | st.text(max_size=40) | st.sampled_from(["", "/", "..", "/etc"]))
    return pb.LoadAdapterRequest(name=draw(names), path=path, replace=draw(st.booleans()),
                                 pin=draw(st.booleans()))


# ---- fixtures ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, tiny_adapters) -> Path:
    root = tmp_path_factory.mktemp("fuzz_root")
    shutil.copytree(tiny_adapters("a0"), root / "ok")
    shutil.copytree(tiny_adapters("a0"), root / "no-config")
    (root / "no-config" / "adapter_config.json").unlink()
    return root


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path, root: Path) -> Any:
    return serve(lambda: make_engine(tiny_llama, max_model_len=MAX_MODEL_LEN,
                                     max_loras=MAX_LORAS, lora_modules={GOOD: str(root / "ok")},
                                     served_model_name=ALIAS),
                 adapter_roots=[root])


@pytest.fixture(scope="module")
def stubs(server: Any):
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.InferenceStub(channel), pb_grpc.AdapterAdminStub(channel)


@pytest.fixture(scope="module")
def client(server: Any):
    with server.client() as c:
        yield c


# ---- properties --------------------------------------------------------------------------
def check_generate(stubs: Any, request: pb.GenerateRequest, stream: bool) -> None:
    inference, _ = stubs
    try:
        if stream:
            chunks = list(inference.GenerateStream(request, timeout=60))
            token_ids = [t for c in chunks for t in c.token_ids]
            reason, usage = chunks[-1].finish_reason, chunks[-1].usage
            assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
        else:
            reply = inference.Generate(request, timeout=60)
            token_ids, reason, usage = list(reply.token_ids), reply.finish_reason, reply.usage
    except grpc.RpcError as err:
        assert err.code().name in GENERATE_OK, (err.code(), err.details(), request)
        assert err.details(), "a status without a message"
        event(err.code().name)
        OUTCOMES[f"generate:{err.code().name}"] += 1
        return
    event("OK")
    OUTCOMES["generate:OK"] += 1
    assert reason in FINISH_REASONS, reason
    assert usage.completion_tokens == len(token_ids) >= 1
    assert all(0 <= t < VOCAB for t in token_ids)
    params = request.params
    if params.HasField("max_new_tokens"):
        assert len(token_ids) <= params.max_new_tokens
    assert usage.prompt_tokens + len(token_ids) <= MAX_MODEL_LEN


def check_load(stubs: Any, request: pb.LoadAdapterRequest) -> None:
    _, admin = stubs
    try:
        info = admin.LoadAdapter(request, timeout=60)
    except grpc.RpcError as err:
        assert err.code().name in LOAD_OK, (err.code(), err.details(), request)
        assert err.details(), "a status without a message"
        event(err.code().name)
        OUTCOMES[f"load:{err.code().name}"] += 1
        return
    event("OK")
    OUTCOMES["load:OK"] += 1
    assert info.name == request.name and info.rank > 0
    if request.name != GOOD:  # keep the server's adapter set (and pins) as it was
        admin.UnloadAdapter(pb.UnloadAdapterRequest(name=request.name), timeout=60)


def assert_healthy_and_idle(client: Any, server: Any) -> None:
    assert client.health() == "SERVING"
    reply = client.generate("the cat", adapter=GOOD, max_new_tokens=2, ignore_eos=True)
    assert reply.usage.completion_tokens == 2
    deadline = time.monotonic() + 10
    while True:
        s = client.stats()
        if (s.kv_blocks_used, s.lora_slots_in_use, s.num_in_flight) == (0, 0, 0):
            break
        assert time.monotonic() < deadline, f"not idle: {s}"
        time.sleep(0.02)
    assert [a.name for a in client.list_adapters()] == [GOOD]
    assert server.engine.lora.slots_in_use == 0 and not server.engine.requests


def test_fuzz_generate(stubs: Any, client: Any, server: Any) -> None:
    @BOUNDED
    @given(request=generate_requests(), stream=st.booleans())
    def run(request: pb.GenerateRequest, stream: bool) -> None:
        check_generate(stubs, request, stream)

    run()
    assert_healthy_and_idle(client, server)
    print(dict(OUTCOMES))
    assert OUTCOMES["generate:OK"] >= 3 and OUTCOMES["generate:INVALID_ARGUMENT"] >= 3


def test_fuzz_load_adapter(stubs: Any, client: Any, server: Any, root: Path) -> None:
    @BOUNDED
    @given(request=load_requests(root))
    def run(request: pb.LoadAdapterRequest) -> None:
        check_load(stubs, request)

    run()
    assert_healthy_and_idle(client, server)


@pytest.mark.slow
def test_fuzz_generate_long(stubs: Any, client: Any, server: Any) -> None:
    @LONG
    @given(request=generate_requests(), stream=st.booleans())
    def run(request: pb.GenerateRequest, stream: bool) -> None:
        check_generate(stubs, request, stream)

    run()
    assert_healthy_and_idle(client, server)


@pytest.mark.slow
def test_fuzz_load_adapter_long(stubs: Any, client: Any, server: Any, root: Path) -> None:
    @LONG
    @given(request=load_requests(root))
    def run(request: pb.LoadAdapterRequest) -> None:
        check_load(stubs, request)

    run()
    assert_healthy_and_idle(client, server)
