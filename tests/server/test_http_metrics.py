"""/metrics as Prometheus scrapes it, parsed with prometheus_client's own parser: every
vLLM-named family with its type, counters that rise by exactly the tokens served on both
fronts, vllm:lora_requests_info naming the adapter of a running request, and
``--max-queue`` counting gRPC and HTTP requests together."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import slow_steps, wait_until

VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:lora_requests_info": "gauge",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
}
OWN_FAMILIES = {
    "loraplex:adapter_requests": "counter", "loraplex:adapter_prompt_tokens": "counter",
    "loraplex:adapter_generation_tokens": "counter",
    "loraplex:adapter_load_seconds": "histogram", "loraplex:adapters_resident": "gauge",
    "loraplex:adapter_lookups": "counter",
}


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path, tiny_adapters: Callable[[str], Path]) -> Any:
    modules = {"a": str(tiny_adapters("a0")), "b": str(tiny_adapters("a1"))}
    return serve(lambda: make_engine(tiny_llama, lora_modules=modules, max_loras=2,
                                     served_model_name="tiny"),
                 http_port=0)


@pytest.fixture(scope="module")
def oai(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0,
                         timeout=60)


def scrape(server: Any) -> dict[str, Any]:
    r = httpx.get(f"{server.http_url}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(families: dict[str, Any], sample: str, absent: float | None = None,
          **labels: str) -> float:
    """The one sample named ``sample`` whose labels include ``labels`` (``absent`` if there
    is none and that is allowed: per-adapter series appear with an adapter's first use)."""
    hits = [s.value for f in families.values() for s in f.samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    if not hits and absent is not None:
        return absent
    assert len(hits) == 1, (sample, labels, hits)
    return hits[0]


def test_every_family_is_exposed_with_its_type(server: Any) -> None:
    families = scrape(server)
    for name, kind in {**VLLM_FAMILIES, **OWN_FAMILIES}.items():
        assert name in families, f"{name} missing"
        assert families[name].type == kind, (name, families[name].type)
    running = families["vllm:num_requests_running"].samples[0]
    assert running.labels == {"model_name": "tiny"}
    info = families["vllm:lora_requests_info"].samples
    assert len(info) == 1 and info[0].labels["max_lora"] == "2"
    buckets = [s.labels["le"] for s in families["vllm:time_to_first_token_seconds"].samples
               if s.name.endswith("_bucket")]
    assert buckets[:3] == ["0.001", "0.005", "0.01"] and buckets[-1] == "+Inf"
    # registered from --lora-modules: metadata only, so on disk until a request needs them
    assert value(families, "loraplex:adapters_resident", tier="disk") == 2


def test_counters_rise_by_exactly_the_tokens_served(server: Any, oai: openai.OpenAI) -> None:
    before = scrape(server)
    served = [oai.completions.create(model="a", prompt="the cat sat", max_tokens=5,
                                     temperature=0, extra_body={"ignore_eos": True}).usage,
              oai.chat.completions.create(model="tiny", messages=[{"role": "user",
                                          "content": "the dog"}], max_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True}).usage]
    with server.client() as client:
        grpc_usage = client.generate("one two three", adapter="b", max_new_tokens=4,
                                     ignore_eos=True).usage
    after = scrape(server)

    def delta(sample: str, **labels: str) -> float:
        return value(after, sample, **labels) - value(before, sample, absent=0.0, **labels)

    prompt = sum(u.prompt_tokens for u in served) + grpc_usage.prompt_tokens
    generated = sum(u.completion_tokens for u in served) + grpc_usage.completion_tokens
    assert generated == 5 + 3 + 4
    assert delta("vllm:prompt_tokens_total", model_name="tiny") == prompt
    assert delta("vllm:generation_tokens_total", model_name="tiny") == generated
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == generated - 3
    for adapter, usage in (("a", served[0]), ("tiny", served[1]), ("b", grpc_usage)):
        assert delta("loraplex:adapter_generation_tokens_total", adapter=adapter) == \
            usage.completion_tokens
        assert delta("loraplex:adapter_prompt_tokens_total", adapter=adapter) == \
            usage.prompt_tokens


@contextmanager
def running_stream(server: Any, model: str) -> Iterator[Iterator[str]]:
    """A streamed completion for ``model``, its first event read (so it runs), left open;
    its remaining lines. (Dropping a line iterator closes the response: a disconnect.)"""
    body = {"model": model, "prompt": "the cat", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    url = f"{server.http_url}/v1/completions"
    with slow_steps(server.engine, 0.01), httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = json.loads(next(lines).removeprefix("data: "))
        assert first["choices"][0]["finish_reason"] is None, first
        yield lines


def test_lora_requests_info_lists_the_running_adapter(server: Any) -> None:
    with running_stream(server, "a"):
        families = scrape(server)
        latest = max(families["vllm:lora_requests_info"].samples, key=lambda s: s.value)
        assert "a" in latest.labels["running_lora_adapters"].split(",")
        assert latest.labels["waiting_lora_adapters"] == ""
        assert value(families, "vllm:num_requests_running") == 1
        assert value(families, "vllm:kv_cache_usage_perc") > 0
    wait_until(lambda: not server.engine.requests, what="the stream's abort")
    families = scrape(server)
    latest = max(families["vllm:lora_requests_info"].samples, key=lambda s: s.value)
    assert latest.labels["running_lora_adapters"] == ""
    assert value(families, "vllm:num_requests_running") == 0


def test_adapter_loads_are_timed_by_tier(server: Any, tiny_adapters: Callable[[str], Path]
                                         ) -> None:
    before = scrape(server)
    r = httpx.post(f"{server.http_url}/v1/load_lora_adapter",
                   json={"lora_name": "c", "lora_path": str(tiny_adapters("a2"))}, timeout=60)
    assert r.status_code == 200
    with server.client() as client:
        assert client.generate("the cat", adapter="c", max_new_tokens=2).usage
    after = scrape(server)
    for tier in ("host", "device"):
        count = "loraplex:adapter_load_seconds_count"
        assert value(after, count, tier=tier) >= value(before, count, tier=tier) + 1


def test_max_queue_counts_both_fronts(server: Any, oai: openai.OpenAI) -> None:
    state = server.server.state
    options = state.options  # frozen: the state is given options with one place instead
    state.options = dataclasses.replace(options, max_queue=1)
    try:
        with running_stream(server, "b"):  # the one place, taken over HTTP
            with server.client() as client, pytest.raises(grpc.RpcError) as info:
                client.generate("the cat", max_new_tokens=2)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(openai.RateLimitError) as rate:
                oai.completions.create(model="a", prompt="the cat", max_tokens=2)
            assert rate.value.response.headers["retry-after"] == "1"
            assert "--max-queue 1" in rate.value.message
    finally:
        state.options = options
    wait_until(lambda: state.in_flight == 0, what="the stream's place freed")
