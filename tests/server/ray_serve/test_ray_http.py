"""loraplex's OpenAI-compatible HTTP front on Ray Serve: the same two replicas as the gRPC
tests (conftest.py), reached through Ray's HTTP proxy with the official ``openai`` client and
httpx. Outputs equal the gRPC front's (whose token ids equal PEFT's); load and unload over
HTTP reach every replica; /metrics shows every replica; Ray's multiplexing header routes an
adapter's requests to the replica holding it. Runs before the fault tests (test_ray_serve_faults.py)."""

from __future__ import annotations

import collections
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from loraplex.client import Client
from prometheus_client.parser import text_string_to_metric_families

from tests.server.ray_serve.conftest import ADMIN, NAMES, PROMPTS, N, replica_ids
from tests.server.ray_serve.conftest import REPLICA as HEADER

IGNORE_EOS = {"ignore_eos": True}
BEARER = {"Authorization": f"Bearer {ADMIN}"}  # the only token guards the API routes too

@pytest.fixture(scope="module")
def oai(ray_app: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{ray_app.http_url}/v1", api_key=ADMIN, max_retries=0)


def reference(client: Client, adapter: str, ids: list[int], expected: list[int]) -> str:
    """The gRPC front's text for ``ids``, after checking its tokens are ``expected``
    (PEFT's)."""
    ref = client.generate(prompt_token_ids=ids, adapter=adapter, temperature=0.0,
                          max_new_tokens=N, ignore_eos=True)
    assert list(ref.token_ids) == expected
    return ref.text


def complete(url: str, adapter: str, ids: list[int], headers: dict | None = None
             ) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers={**BEARER, **(headers or {})},
                      timeout=60, json={
        "model": adapter, "prompt": ids, "max_tokens": N, "temperature": 0.0, **IGNORE_EOS})


def spread(url: str, adapter: str, ids: list[int], n: int = 24) -> list[httpx.Response]:
    """``n`` concurrent completions without Ray's multiplexing header: Ray spreads them."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda _: complete(url, adapter, ids), range(n)))


def test_every_adapter_equals_the_grpc_front(oai: openai.OpenAI, client: Client,
                                             peft_reference: Any) -> None:
    for name, ids in zip(NAMES, PROMPTS):
        text = reference(client, name, ids, peft_reference(name, ids, N))
        http = oai.completions.create(model=name, prompt=ids, max_tokens=N, temperature=0.0,
                                      extra_body=IGNORE_EOS)
        assert http.choices[0].text == text and http.usage.prompt_tokens == len(ids)
        stream = oai.completions.create(model=name, prompt=ids, max_tokens=N, temperature=0.0,
                                        extra_body=IGNORE_EOS, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == text
    assert set(NAMES) <= {m.id for m in oai.models.list().data}
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt=[1, 2], max_tokens=2)


def test_health_and_the_replica_header(ray_app: Any, client: Client) -> None:
    """Every response names its replica; 16 probes without affinity reach both
    (all on one: p = 2^-15)."""
    replies = [httpx.get(f"{ray_app.http_url}/health") for _ in range(16)]
    assert all(r.status_code == 200 for r in replies)
    assert {r.headers[HEADER] for r in replies} == replica_ids(client)


def test_load_over_http_reaches_every_replica_unload_too(ray_app: Any, client: Client,
                                                         tiny_adapters: Any,
                                                         peft_reference: Any) -> None:
    url, admin = ray_app.http_url, {"Authorization": f"Bearer {ADMIN}"}
    r = httpx.post(f"{url}/v1/load_lora_adapter", headers=admin, timeout=60,
                   json={"lora_name": "web", "lora_path": str(tiny_adapters("hot"))})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'web' added successfully.")
    ids = PROMPTS[1]
    text = reference(client, "web", ids, peft_reference("hot", ids, N))  # hot's weights
    replies = spread(url, "web", ids)  # at once, no retry
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert {r.json()["choices"][0]["text"] for r in replies} == {text}
    assert {r.headers[HEADER] for r in replies} == replica_ids(client)  # both replicas
    infos = {i.name: i for i in client.list_adapters()}
    assert len(infos["web"].replicas) == 2 and all(rep.state for rep in infos["web"].replicas)
    r = httpx.post(f"{url}/v1/unload_lora_adapter", headers=admin, json={"lora_name": "web"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'web' removed successfully.")
    replies = spread(url, "web", ids)
    assert all(r.status_code == 404 for r in replies), [r.text for r in replies]
    assert {r.headers[HEADER] for r in replies} == replica_ids(client)
    assert "web" not in {i.name for i in client.list_adapters()}


def test_admin_over_http_needs_the_admin_token(ray_app: Any, tiny_adapters: Any) -> None:
    r = httpx.post(f"{ray_app.http_url}/v1/load_lora_adapter",
                   json={"lora_name": "x", "lora_path": str(tiny_adapters("hot"))})
    assert r.status_code == 401 and "--admin-token" in r.json()["error"]["message"]


def test_metrics_show_every_replica(ray_app: Any, client: Client) -> None:
    r = httpx.get(f"{ray_app.http_url}/metrics")
    assert r.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("vllm:num_requests_running", "vllm:prompt_tokens", "vllm:kv_cache_usage_perc"):
        labelled = {s.labels.get("replica") for s in families[name].samples}
        assert labelled == replica_ids(client), (name, labelled)
    tokens = sum(s.value for s in families["vllm:prompt_tokens"].samples
                 if s.name.endswith("_total"))
    assert tokens >= sum(len(p) for p in PROMPTS)  # the requests above, on either replica


def test_a_closed_stream_frees_its_kv_blocks(ray_app: Any, client: Client) -> None:
    """A client that leaves an SSE stream mid-way: the disconnect crosses Ray's HTTP proxy
    and the replica, the engine aborts the request."""
    body = {"model": "a0", "prompt": [9, 9, 9], "max_tokens": 240, "temperature": 0.0,
            "stream": True, **IGNORE_EOS}
    aborted = aborts(ray_app.http_url)
    with httpx.stream("POST", f"{ray_app.http_url}/v1/completions", json=body,
                      timeout=60, headers=BEARER) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    deadline = time.monotonic() + 10
    while True:
        s = client.stats()
        if (s.num_running, s.num_waiting, s.num_in_flight, s.kv_blocks_used) == (0, 0, 0, 0):
            break
        assert time.monotonic() < deadline, s
        time.sleep(0.1)
    assert aborts(ray_app.http_url) == aborted + 1  # ended by the disconnect, not by length


def aborts(url: str) -> float:
    """Requests ended by abort, summed over the replicas' /metrics."""
    text = httpx.get(f"{url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text)
               if f.name == "vllm:request_success" for s in f.samples
               if s.name.endswith("_total") and s.labels.get("finished_reason") == "abort")


def test_multiplexing_header_routes_to_the_holder(ray_app: Any, client: Client,
                                                  tiny_adapters: Any) -> None:
    """Ray's proxy routes on ``serve_multiplexed_model_id``, not on the body's model: a
    client sending it gets affinity as a gRPC client sending the metadata does."""
    client.load_adapter("webaff", tiny_adapters("aff"))
    routed = {"serve_multiplexed_model_id": "webaff"}
    holder = complete(ray_app.http_url, "webaff", [3, 4, 5], routed).headers[HEADER]
    time.sleep(1.0)  # replicas report what they hold every 0.1 s, through the controller
    landed = collections.Counter(
        complete(ray_app.http_url, "webaff", [3, 4, 5], routed).headers[HEADER]
        for _ in range(20))
    print(f"\n[ray] HTTP affinity: {landed[holder]}/20 on the holder ({dict(landed)})")
    client.unload_adapter("webaff")
    assert landed[holder] >= 18, (holder, landed)
