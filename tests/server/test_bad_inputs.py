"""A table of bad inputs through the real server: each gets its exact status code and a
message that names what was wrong, and a healthy request right after it still gets the
engine's own greedy answer. The HTTP front gets a table of its own on the same server
(status and OpenAI error body), and a client disconnect mid-request. After the whole table
nothing is left holding a KV block or an adapter slot.

Cases are data (bad_input_cases.py): ``Case(id, call, kwargs, code, fragment)``; ``call``
is ``generate`` (sent unary and streaming), ``load`` or ``unload``; a ``load`` path written
``@name`` is the broken adapter dir ``name`` made by ``BROKEN[name]`` (broken_adapters.py)
under the adapter root.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf.message import Message
from loraplex import SamplingParams
from loraplex.proto import loraplex_pb2 as pb

from tests.server.bad_http_cases import HTTP_CASES, HttpCase
from tests.server.bad_input_cases import (
    ALIAS,
    ALL_CASES,
    GENERATE_CASES,
    GOOD,
    Case,
)
from tests.server.broken_adapters import BROKEN, CONFIG, WEIGHTS
from tests.server.conftest import slow_steps, wait_until

HEALTHY_IDS = [10, 20, 30]
HEALTHY_N = 4




@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, tiny_adapters,
           make_adapter_dir) -> dict[str, Path]:
    """The adapter root with ``ok`` (a good adapter), every BROKEN dir, ``rank-32`` and
    ``symlink-out``; ``outside`` (a good adapter out of the root) and ``other_base``."""
    top = tmp_path_factory.mktemp("bad_inputs")
    root, outside = top / "root", top / "outside"
    root.mkdir()
    good = tiny_adapters("a0")
    shutil.copytree(good, root / "ok")
    shutil.copytree(good, outside)
    # a base of another size (only config.json is read), inside the root: a confined
    # adapter's base_model_name_or_path is followed only there
    other_base = root / "other_base"
    other_base.mkdir()
    cfg = json.loads((tiny_llama / "config.json").read_text())
    (other_base / "config.json").write_text(json.dumps({**cfg, "hidden_size": 128}))
    extra = {"other_base": other_base, "outside": outside}
    for name, breaks in BROKEN.items():
        shutil.copytree(good, root / name)
        breaks(root / name, extra)
    make_adapter_dir(tiny_llama, root / "rank-32", r=32)
    (root / "symlink-out").symlink_to(outside, target_is_directory=True)
    return {"root": root, "ok": root / "ok", "model": tiny_llama, **extra}


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path, layout: dict[str, Path]) -> Any:
    return serve(lambda: make_engine(tiny_llama, lora_modules={GOOD: str(layout["ok"])},
                                     served_model_name=ALIAS),
                 adapter_roots=[layout["root"]], http_port=0)


@pytest.fixture(scope="module")
def client(server: Any):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def healthy_reference(make_engine, tiny_llama: Path, layout: dict[str, Path]) -> list[int]:
    engine = make_engine(tiny_llama, lora_modules={GOOD: str(layout["ok"])})
    params = SamplingParams(temperature=0.0, max_new_tokens=HEALTHY_N, ignore_eos=True)
    return engine.generate([HEALTHY_IDS], params, adapters=[GOOD])[0].token_ids


def _path(value: str, layout: dict[str, Path]) -> str:
    return str(layout["root"] / value[1:]) if value.startswith("@") else value


def send(client: Any, case: Case, stream: bool, layout: dict[str, Path]) -> Any:
    kw = dict(case.kwargs)
    if case.call == "generate":
        prompt = kw.pop("prompt")
        if not stream:
            return client.generate(prompt, timeout=30, **kw)
        return list(client.generate_stream(prompt, timeout=30, **kw))
    if case.call == "load":
        return client.load_adapter(kw.pop("name"), _path(kw.pop("path"), layout), timeout=30,
                                   **kw)
    if case.call == "upload":
        return client._s.admin.UploadAdapter(iter(upload_messages(kw, layout)),
                                             **client._s.adm(30))
    return client.unload_adapter(kw["name"], timeout=30)


def upload_messages(kw: dict[str, Any], layout: dict[str, Path]) -> list[pb.UploadAdapterRequest]:
    """An upload case's stream (bad_input_cases.py ``upload``)."""
    if kw.get("messages") == "none":
        return []
    d = Path(_path(kw["path"], layout))
    config, weights = (d / CONFIG).read_text(), (d / WEIGHTS).read_bytes()
    header = pb.UploadAdapterHeader(name=kw["name"], adapter_config=kw.get("config", config),
                                    replace=kw.get("replace", False),
                                    size_bytes=kw.get("size_bytes", len(weights)))
    chunks = [pb.UploadAdapterRequest(chunk=weights[i:i + 1024])
              for i in range(0, len(weights), 1024)]
    if kw.get("extra_header"):
        chunks.insert(1, pb.UploadAdapterRequest(header=header))
    if kw.get("first") == "chunk":
        return chunks
    return [pb.UploadAdapterRequest(header=header), *chunks]


PARAMS = [pytest.param(c, False, id=c.id) for c in ALL_CASES] + \
    [pytest.param(c, True, id=f"stream-{c.id}") for c in GENERATE_CASES]


def test_table_is_big_enough() -> None:
    assert len(ALL_CASES) >= 40
    assert len({c.id for c in ALL_CASES}) == len(ALL_CASES)
    sp_fields = {"temperature", "top_p", "top_k", "seed", "max_new_tokens", "min_new_tokens",
                 "stop", "stop_token_ids", "n", "logprobs", "prompt_logprobs",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                 "min_p", "allowed_token_ids"}  # ignore_eos is a bool: no bad value exists
    assert sp_fields <= {k for c in GENERATE_CASES for k in c.kwargs}


@pytest.mark.parametrize("case,stream", PARAMS)
def test_bad_input(client: Any, layout: dict[str, Path], healthy_reference: list[int],
                   case: Case, stream: bool) -> None:
    with pytest.raises(grpc.RpcError) as info:
        result = send(client, case, stream, layout)
        assert not isinstance(result, Message), f"accepted: {result}"
    err = info.value
    assert err.code().name == case.code, err.details()
    assert case.fragment in err.details(), err.details()
    sent = _path(case.kwargs["path"], layout) if case.call == "load" else ""
    assert_no_internal_path(err.details(), sent, layout)
    assert "loraplex-uploads-" not in err.details()  # never the upload store's paths
    healthy = client.generate(prompt_token_ids=HEALTHY_IDS, adapter=GOOD, temperature=0.0,
                              max_new_tokens=HEALTHY_N, ignore_eos=True, timeout=30)
    assert list(healthy.token_ids) == healthy_reference


# ---- the same server over HTTP ----------------------------------------------------------
def test_http_table_is_big_enough() -> None:
    assert len(HTTP_CASES) >= 25 and len({c.id for c in HTTP_CASES}) == len(HTTP_CASES)


@pytest.mark.parametrize("case", HTTP_CASES, ids=[c.id for c in HTTP_CASES])
def test_bad_http_input(server: Any, client: Any, layout: dict[str, Path], case: HttpCase,
                        healthy_reference: list[int]) -> None:
    body = case.body
    if isinstance(body, dict) and "lora_path" in body:
        body = {**body, "lora_path": _path(body["lora_path"], layout)}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.http_url + case.path, content=content, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == case.status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == case.status
    assert case.fragment in error["message"], error
    assert_no_internal_path(error["message"], body.get("lora_path", "")
                            if isinstance(body, dict) else "", layout)
    assert server.server.state.in_flight == 0
    healthy = client.generate(prompt_token_ids=HEALTHY_IDS, adapter=GOOD, temperature=0.0,
                              max_new_tokens=HEALTHY_N, ignore_eos=True, timeout=30)
    assert list(healthy.token_ids) == healthy_reference


def assert_no_internal_path(message: str, sent: str, layout: dict[str, Path]) -> None:
    """No message shows a server-internal path (issue 42): what is left once the path the
    client sent and the adapter's own base_model_name_or_path are taken out holds neither
    the adapter root, the temp dir, nor the model dir."""
    shown = message.replace(sent, "<sent>") if sent else message
    shown = shown.replace(str(layout["other_base"]), "<its base>")
    for internal in (str(layout["root"]), tempfile.gettempdir(), str(layout["model"])):
        assert internal not in shown, (internal, message)


def _aborted(server: Any) -> float:
    value = server.server.state.metrics.registry.get_sample_value(
        "vllm:request_success_total", {"model_name": ALIAS, "finished_reason": "abort"})
    return value or 0.0


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_http_disconnect_mid_request_aborts(server: Any, stream: bool) -> None:
    """The client goes away while its request runs: the engine aborts the sequence (an
    abort is counted), its KV blocks are freed and its --max-queue place is given back."""
    body = {"model": GOOD, "prompt": "the cat", "max_tokens": 200, "ignore_eos": True,
            "stream": stream}
    aborted = _aborted(server)
    engine = server.engine
    with slow_steps(engine, 0.01):
        if stream:
            with httpx.stream("POST", f"{server.http_url}/v1/completions", json=body,
                              timeout=30) as r:
                lines = r.iter_lines()
                assert json.loads(next(lines).removeprefix("data: "))["choices"]
        else:  # a whole answer: the client times out while the engine runs it
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=0.3)
        wait_until(lambda: _aborted(server) == aborted + 1, what="the abort")
    wait_until(lambda: not engine.requests and engine.block_manager.num_used_blocks == 0
               and server.server.state.in_flight == 0, what="nothing held")


def test_nothing_leaks_after_the_table(client: Any, server: Any) -> None:
    """Runs after the table (file order): no KV block, slot or in-flight place is held, the
    adapters are exactly the preloaded one, and health still says SERVING."""
    stats = client.stats()
    assert (stats.kv_blocks_used, stats.lora_slots_in_use, stats.num_in_flight) == (0, 0, 0)
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    engine = server.engine
    assert engine.lora.slots_in_use == 0 and not engine.requests
    assert [a.name for a in client.list_adapters()] == [GOOD]
    assert list(engine.uploads.root.iterdir()) == []  # no upload left a directory
    assert client.health() == "SERVING"
