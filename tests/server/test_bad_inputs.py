"""A table of bad inputs through the real server: each gets its exact status code and a
message that names what was wrong, and a healthy request right after it still gets the
engine's own greedy answer. The HTTP front gets a table of its own on the same server
(status and OpenAI error body), and a client disconnect mid-request. After the whole table
nothing is left holding a KV block or an adapter slot.

Cases are data: ``Case(id, call, kwargs, code, fragment)``. ``call`` is ``generate`` (sent
unary and streaming), ``load`` or ``unload``; a ``load`` path written ``@name`` is the broken
adapter dir ``name`` made by ``BROKEN[name]`` under the adapter root.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from google.protobuf.message import Message
from loraplex import SamplingParams
from safetensors.torch import load_file, save_file

from tests.server.conftest import slow_steps, wait_until

ALIAS = "tiny-base"
GOOD = "good"
HEALTHY_IDS = [10, 20, 30]
HEALTHY_N = 4
VOCAB = 384  # tests/conftest.py TINY_COMMON
MAX_MODEL_LEN = 256  # tests/server/conftest.py ENGINE_KW
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class Case:
    id: str
    call: str  # generate | load | unload
    kwargs: dict[str, Any] = field(hash=False)
    code: str  # grpc.StatusCode name
    fragment: str  # the message must contain it


def gen(id: str, code: str, fragment: str, **kwargs: Any) -> Case:
    kwargs.setdefault("prompt", "the cat")
    return Case(id, "generate", kwargs, code, fragment)


def load(id: str, code: str, fragment: str, name: str = "new", path: str = "@ok",
         **kwargs: Any) -> Case:
    return Case(id, "load", {"name": name, "path": path, **kwargs}, code, fragment)


INVALID, NOT_FOUND = "INVALID_ARGUMENT", "NOT_FOUND"
NAN, INF = math.nan, math.inf

GENERATE_CASES = [
    # SamplingParams, field by field
    gen("temperature-negative", INVALID, "temperature", temperature=-0.5),
    gen("temperature-nan", INVALID, "temperature", temperature=NAN),
    gen("temperature-inf", INVALID, "temperature", temperature=INF),
    gen("top_p-zero", INVALID, "top_p", top_p=0.0),
    gen("top_p-negative", INVALID, "top_p", top_p=-0.1),
    gen("top_p-above-one", INVALID, "top_p", top_p=1.5),
    gen("top_p-nan", INVALID, "top_p", top_p=NAN),
    gen("top_k-minus-two", INVALID, "top_k", top_k=-2),
    gen("top_k-int32-min", INVALID, "top_k", top_k=-(2**31)),
    gen("seed-2**63", INVALID, "seed", seed=2**63),
    gen("seed-uint64-max", INVALID, "seed", seed=2**64 - 1),
    gen("max_new_tokens-zero", INVALID, "max_new_tokens", max_new_tokens=0),
    gen("max_new_tokens-uint32-max", INVALID, "does not fit", max_new_tokens=2**32 - 1),
    gen("max_new_tokens-past-max_model_len", INVALID, "at most",
        prompt_token_ids=[5] * 250, prompt=None, max_new_tokens=10),
    gen("min_new_tokens-above-max_new_tokens", INVALID, "min_new_tokens", max_new_tokens=2,
        min_new_tokens=5),
    gen("min_new_tokens-huge-no-max", INVALID, "min_new_tokens", min_new_tokens=2**32 - 1),
    gen("stop-empty-string", INVALID, "stop strings", stop=["ok", ""]),
    gen("stop_token_ids-equal-vocab", INVALID, "stop_token_ids", stop_token_ids=[VOCAB],
        min_new_tokens=1),
    gen("stop_token_ids-uint32-max", INVALID, "stop_token_ids", stop_token_ids=[2**32 - 1],
        min_new_tokens=2),
    # prompts
    gen("prompt-missing", INVALID, "no prompt", prompt=None),
    gen("prompt-only-spaces", INVALID, "prompt is empty", prompt="   "),
    gen("prompt-ids-over-max_model_len", INVALID, "max_model_len", prompt=None,
        prompt_token_ids=[5] * MAX_MODEL_LEN),
    gen("prompt-text-over-max_model_len", INVALID, "max_model_len", prompt="the " * 300),
    gen("prompt-and-prompt_token_ids", INVALID, "exactly one", prompt_token_ids=[5, 6]),
    gen("token-id-equal-vocab", INVALID, "out of range", prompt=None,
        prompt_token_ids=[5, VOCAB]),
    gen("token-id-uint32-max", INVALID, "out of range", prompt=None,
        prompt_token_ids=[2**32 - 1]),
    gen("chat-template-on-token-ids", INVALID, "apply_chat_template", prompt=None,
        prompt_token_ids=[5], apply_chat_template=True),
    gen("request_id-over-long", INVALID, "request_id", request_id="r" * 257),
    gen("messages-and-prompt", INVALID, "exactly one",
        messages=[{"role": "user", "content": "the cat"}]),
    gen("messages-role-unknown", INVALID, "role", prompt=None,
        messages=[{"role": "wizard", "content": "the cat"}]),
    gen("messages-over-max_model_len", INVALID, "max_model_len", prompt=None,
        messages=[{"role": "user", "content": "the " * 300}]),
    # adapter names
    gen("adapter-unknown", NOT_FOUND, "'nope'", adapter="nope"),
    gen("adapter-over-long", NOT_FOUND, "unknown adapter", adapter="x" * 20000),
    gen("adapter-control-chars", NOT_FOUND, "unknown adapter", adapter="a\x00b\n\x1b[2J"),
    gen("adapter-unloaded-never-loaded-path", NOT_FOUND, "unknown adapter",
        adapter="../../etc/passwd"),
]

LOAD_CASES = [
    # names
    load("name-empty", INVALID, "name is empty", name=""),
    load("name-over-long", INVALID, "1 to 128 characters", name="n" * 129),
    load("name-control-char", INVALID, "not allowed", name="bad\x07name"),
    load("name-newline", INVALID, "not allowed", name="bad\nname"),
    load("name-leading-dot", INVALID, "not allowed", name=".hidden"),
    load("name-is-served-model-name", INVALID, "served model name", name=ALIAS),
    load("name-duplicate", "ALREADY_EXISTS", "already exists", name=GOOD),
    # paths
    load("path-empty", INVALID, "path is empty", path=""),
    load("path-missing", INVALID, "does not exist", path="@missing"),
    load("path-dotdot-escape", "PERMISSION_DENIED", "outside the adapter roots",
         path="@ok/../../outside"),
    load("path-relative-escape", "PERMISSION_DENIED", "outside the adapter roots",
         path="../../../../../../etc"),
    load("path-symlink-out-of-root", "PERMISSION_DENIED", "outside the adapter roots",
         path="@symlink-out"),
    load("path-is-a-file", INVALID, "is a file", path=f"@ok/{CONFIG}"),
    # contents
    load("no-config", INVALID, f"{CONFIG} is missing", path="@no-config"),
    load("config-without-weights", INVALID, f"{WEIGHTS} is missing", path="@no-weights"),
    load("config-unparsable-json", INVALID, "not readable JSON", path="@bad-json"),
    load("config-json-list", INVALID, "JSON object", path="@json-list"),
    load("config-zero-bytes", INVALID, "is empty", path="@empty-config"),
    load("config-not-lora", INVALID, "not a LoRA adapter", path="@prefix-tuning"),
    load("config-dora", INVALID, "use_dora", path="@dora"),
    load("config-bias", INVALID, "bias='all'", path="@bias"),
    load("config-modules_to_save", INVALID, "modules_to_save", path="@modules-to-save"),
    load("config-target-embed_tokens", INVALID, "cannot be wrapped", path="@embed-target"),
    load("rank-over-limit", INVALID, "above max_lora_rank", path="@rank-32"),
    load("another-base-model", INVALID, "differs from the served base", path="@other-base"),
    load("wrong-shapes", INVALID, "has shape", path="@wrong-shape"),
    load("pickle-bin-only", INVALID, "pickle", path="@pickle-only"),
    load("truncated-safetensors", INVALID, "truncated or corrupt", path="@truncated"),
    load("garbage-safetensors", INVALID, "truncated or corrupt", path="@garbage"),
    load("weights-zero-bytes", INVALID, "is empty (0 bytes)", path="@empty-weights"),
    load("nan-weights", INVALID, "NaN or Inf", path="@nan"),
    load("inf-weights", INVALID, "NaN or Inf", path="@inf"),
    load("integer-weights", INVALID, "floating point", path="@int-weights"),
    load("lora_A-without-lora_B", INVALID, "no matching lora_B", path="@a-only"),
    load("layer-out-of-range", INVALID, "the base model has 2 layers", path="@layer-9"),
    load("non-lora-tensor", INVALID, "not a LoRA weight", path="@base-tensor"),
    load("replace-with-broken-keeps-old", INVALID, "NaN or Inf", name=GOOD, path="@nan",
         replace=True),
]

UNLOAD_CASES = [
    Case("unload-empty-name", "unload", {"name": ""}, INVALID, "name is empty"),
    Case("unload-unknown", "unload", {"name": "nope"}, NOT_FOUND, "unknown adapter 'nope'"),
    Case("unload-control-chars", "unload", {"name": "a\x00b"}, NOT_FOUND, "unknown adapter"),
]

ALL_CASES = GENERATE_CASES + LOAD_CASES + UNLOAD_CASES


# ---- broken adapter dirs -----------------------------------------------------------------
def _edit_config(d: Path, **changes: Any) -> None:
    cfg = json.loads((d / CONFIG).read_text())
    cfg.update(changes)
    (d / CONFIG).write_text(json.dumps(cfg))


def _edit_tensors(d: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(d / WEIGHTS)
    edit(tensors)
    save_file(tensors, d / WEIGHTS)


def _first(tensors: dict[str, torch.Tensor], kind: str = "lora_A") -> str:
    return sorted(k for k in tensors if kind in k)[0]


def _set(key_kind: str, value: Callable[[torch.Tensor], torch.Tensor]
         ) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        k = _first(t, key_kind)
        t[k] = value(t[k])
    return edit


def _poison(x: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def f(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[3] = x
        return t
    return f


def _rename_layer(t: dict[str, torch.Tensor]) -> None:
    for k in [k for k in t if ".layers.0." in k]:
        t[k.replace(".layers.0.", ".layers.9.")] = t.pop(k)


BROKEN: dict[str, Callable[[Path, dict[str, Path]], None]] = {
    "no-config": lambda d, x: (d / CONFIG).unlink(),
    "no-weights": lambda d, x: (d / WEIGHTS).unlink(),
    "bad-json": lambda d, x: (d / CONFIG).write_text('{"peft_type": "LORA", "r": 8,'),
    "json-list": lambda d, x: (d / CONFIG).write_text("[1, 2, 3]"),
    "empty-config": lambda d, x: (d / CONFIG).write_bytes(b""),
    "prefix-tuning": lambda d, x: _edit_config(d, peft_type="PREFIX_TUNING"),
    "dora": lambda d, x: _edit_config(d, use_dora=True),
    "bias": lambda d, x: _edit_config(d, bias="all"),
    "modules-to-save": lambda d, x: _edit_config(d, modules_to_save=["lm_head"]),
    "embed-target": lambda d, x: _edit_config(d, target_modules=["q_proj", "embed_tokens"]),
    "other-base": lambda d, x: _edit_config(d, base_model_name_or_path=str(x["other_base"])),
    "wrong-shape": lambda d, x: _edit_tensors(d, _set("lora_A", lambda a: a[:, :32].clone())),
    "pickle-only": lambda d, x: (torch.save(load_file(d / WEIGHTS), d / "adapter_model.bin"),
                                 (d / WEIGHTS).unlink()),
    "truncated": lambda d, x: (d / WEIGHTS).write_bytes((d / WEIGHTS).read_bytes()[:3000]),
    "garbage": lambda d, x: (d / WEIGHTS).write_bytes(b"\xff" * 64),
    "empty-weights": lambda d, x: (d / WEIGHTS).write_bytes(b""),
    "nan": lambda d, x: _edit_tensors(d, _set("lora_B", _poison(math.nan))),
    "inf": lambda d, x: _edit_tensors(d, _set("lora_A", _poison(-math.inf))),
    "int-weights": lambda d, x: _edit_tensors(d, _set("lora_A", lambda a: a.to(torch.int32))),
    "a-only": lambda d, x: _edit_tensors(d, lambda t: t.pop(_first(t, "lora_B"))),
    "layer-9": lambda d, x: _edit_tensors(d, _rename_layer),
    "base-tensor": lambda d, x: _edit_tensors(
        d, lambda t: t.__setitem__("base_model.model.model.norm.weight", torch.ones(64))),
}


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
    other_base = top / "other_base"  # a base of another size: only config.json is read
    other_base.mkdir()
    cfg = json.loads((tiny_llama / "config.json").read_text())
    (other_base / "config.json").write_text(json.dumps({**cfg, "hidden_size": 128}))
    extra = {"other_base": other_base}
    for name, breaks in BROKEN.items():
        shutil.copytree(good, root / name)
        breaks(root / name, extra)
    make_adapter_dir(tiny_llama, root / "rank-32", r=32)
    (root / "symlink-out").symlink_to(outside, target_is_directory=True)
    return {"root": root, "ok": root / "ok", **extra}


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path, layout: dict[str, Path]) -> Any:
    return serve(lambda: make_engine(tiny_llama, lora_modules={GOOD: str(layout["ok"])}),
                 served_model_name=ALIAS, adapter_roots=[layout["root"]], http_port=0)


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
    return client.unload_adapter(kw["name"], timeout=30)


PARAMS = [pytest.param(c, False, id=c.id) for c in ALL_CASES] + \
    [pytest.param(c, True, id=f"stream-{c.id}") for c in GENERATE_CASES]


def test_table_is_big_enough() -> None:
    assert len(ALL_CASES) >= 40
    assert len({c.id for c in ALL_CASES}) == len(ALL_CASES)
    sp_fields = {"temperature", "top_p", "top_k", "seed", "max_new_tokens", "min_new_tokens",
                 "stop", "stop_token_ids"}  # ignore_eos is a bool: no bad value exists
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
    healthy = client.generate(prompt_token_ids=HEALTHY_IDS, adapter=GOOD, temperature=0.0,
                              max_new_tokens=HEALTHY_N, ignore_eos=True, timeout=30)
    assert list(healthy.token_ids) == healthy_reference


# ---- the same server over HTTP ----------------------------------------------------------
@dataclass(frozen=True)
class HttpCase:
    id: str
    path: str
    body: Any = field(hash=False)  # a dict is sent as JSON; bytes as they are
    status: int = 400
    fragment: str = ""  # the error message must contain it


def completion(id: str, status: int, fragment: str, **fields: Any) -> HttpCase:
    return HttpCase(id, "/v1/completions",
                    {"model": GOOD, "prompt": "the cat", "max_tokens": 2, **fields},
                    status, fragment)


def chat(id: str, status: int, fragment: str, **fields: Any) -> HttpCase:
    body = {"model": GOOD, "messages": [{"role": "user", "content": "the cat"}],
            "max_tokens": 2, **fields}
    return HttpCase(id, "/v1/chat/completions", body, status, fragment)


HTTP_CASES = [
    HttpCase("malformed-json", "/v1/completions", b'{"model": "good", "prompt": ', 400,
             "not valid JSON"),
    HttpCase("body-not-an-object", "/v1/completions", b"[1, 2]", 400, "body"),
    completion("wrong-type-max_tokens", 400, "max_tokens", max_tokens="ten"),
    completion("wrong-type-prompt", 400, "prompt", prompt=5),
    completion("wrong-type-temperature", 400, "temperature", temperature="hot"),
    completion("wrong-type-stream", 400, "stream", stream="yes"),
    chat("wrong-type-messages", 400, "messages", messages="the cat"),
    completion("n-2", 400, "n=2", n=2),
    chat("chat-n-2", 400, "n=2", n=2),
    completion("max_tokens-negative", 400, "max_tokens", max_tokens=-1),
    completion("prompt-over-max_model_len", 400, "max_model_len", prompt="the " * 300),
    completion("prompt-ids-over-max_model_len", 400, "max_model_len",
               prompt=[5] * MAX_MODEL_LEN),
    completion("stream-prompt-over-max_model_len", 400, "max_model_len",
               prompt="the " * 300, stream=True),
    chat("role-unknown", 400, "role", messages=[{"role": "wizard", "content": "hi"}]),
    chat("content-part-unknown", 400, "content",
         messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
    completion("temperature-negative", 400, "temperature", temperature=-1.0),
    completion("stream-temperature-negative", 400, "temperature", temperature=-1.0,
               stream=True),
    completion("token-id-equal-vocab", 400, "out of range", prompt=[5, VOCAB]),
    completion("several-prompts", 400, "one prompt", prompt=["a", "b"]),
    completion("unsupported-logprobs", 400, "logprobs", logprobs=2),
    completion("stream_options-without-stream", 400, "stream_options",
               stream_options={"include_usage": True}),
    completion("model-unknown", 404, "'nope'", model="nope"),
    chat("chat-model-unknown", 404, "'nope'", model="nope"),
    HttpCase("load-name-not-allowed", "/v1/load_lora_adapter",
             {"lora_name": ".hidden", "lora_path": "@ok"}, 400, "not allowed"),
    HttpCase("load-duplicate", "/v1/load_lora_adapter",
             {"lora_name": GOOD, "lora_path": "@ok"}, 400, "already exists"),
    HttpCase("load-outside-root", "/v1/load_lora_adapter",
             {"lora_name": "new", "lora_path": "../../../../../../etc"}, 403,
             "outside the adapter roots"),
    HttpCase("load-broken", "/v1/load_lora_adapter",
             {"lora_name": "new", "lora_path": "@nan"}, 400, "NaN or Inf"),
    HttpCase("load-missing-field", "/v1/load_lora_adapter", {"lora_name": "new"}, 400,
             "lora_path"),
    HttpCase("unload-unknown", "/v1/unload_lora_adapter", {"lora_name": "nope"}, 404,
             "unknown adapter 'nope'"),
]


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
    assert server.server.state.in_flight == 0
    healthy = client.generate(prompt_token_ids=HEALTHY_IDS, adapter=GOOD, temperature=0.0,
                              max_new_tokens=HEALTHY_N, ignore_eos=True, timeout=30)
    assert list(healthy.token_ids) == healthy_reference


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
    assert client.health() == "SERVING"
