"""ServerMetrics: Prometheus series under vLLM's names (so gateways read them unchanged),
plus loraplex's per-adapter series, in a registry of their own per server.

Request series are recorded by the front-neutral generate path (server/generation.py), so
gRPC and HTTP traffic both count. Gauges are refreshed from an EngineSnapshot taken on the
engine thread when /metrics is scraped. prometheus_client appends ``_total`` to counter
names, so counters are declared without it (``vllm:prompt_tokens`` is exposed as
``vllm:prompt_tokens_total``). Every metric object is thread-safe (prometheus_client locks).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine.output_processor import RequestOutput
from .engine_snapshot import LOOKUP_TIERS, TIERS, EngineSnapshot

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0)
FINISHED_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values
LOAD_TIERS = ("host", "device")  # disk -> host memory, host -> device slot

# the engine's finish reasons -> vLLM's (EOS is a "stop" there, as in OpenAI's API)
VLLM_REASON = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}
M = ("model_name",)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = ""
        self.max_loras = 0
        self.running = Gauge("vllm:num_requests_running",
                             "Number of requests in model execution batches.", M, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting",
                             "Number of requests waiting to be processed.", M, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc",
                              "KV-cache usage. 1 means 100 percent usage.", M, registry=r)
        self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                               ("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
                               registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     M, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.", M, registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed "
                               "requests.", (*M, "finished_reason"), registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to "
                              "first token in seconds.", M, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token "
                             "latency in seconds.", M, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request "
                             "latency in seconds.", M, buckets=E2E_BUCKETS, registry=r)
        self._add_adapter_series(r)

    def _add_adapter_series(self, r: CollectorRegistry) -> None:
        a = (*M, "adapter")
        self.adapter_requests = Counter(
            "loraplex:adapter_requests", "Requests finished per adapter (the base model's "
            "under its model name), by vLLM's finished_reason.", (*a, "finished_reason"),
            registry=r)
        self.adapter_prompt_tokens = Counter(
            "loraplex:adapter_prompt_tokens", "Prompt tokens processed per adapter.", a,
            registry=r)
        self.adapter_generation_tokens = Counter(
            "loraplex:adapter_generation_tokens", "Tokens generated per adapter.", a,
            registry=r)
        self.adapter_load = Histogram(
            "loraplex:adapter_load_seconds", "Adapter load time by tier: host = read and "
            "validated from disk into host memory, device = copied into a device slot.",
            (*M, "tier"), buckets=LOAD_BUCKETS, registry=r)
        self.adapters_resident = Gauge(
            "loraplex:adapters_resident", "Registered adapters by the tier they are in "
            "(device, host, disk; failed = the last reload failed).", (*M, "tier"), registry=r)
        self.adapter_lookups = Counter(
            "loraplex:adapter_lookups", "Requests for an adapter by the tier it was found in "
            "when they arrived (device, host, disk): the adapter cache's hit rate per tier.",
            (*M, "tier"), registry=r)
        self.adapter_version = Gauge(
            "loraplex:adapter_version", "The version each registered adapter serves new "
            "requests with (rises with each load of its name; an in-place load is a new "
            "version).", a, registry=r)
        self._lookups_seen: dict[str, int] = {}

    def bind(self, model_name: str, max_loras: int) -> None:
        """Name the served model (the ``model_name`` label) and create every labelled
        series at zero, so each family is exposed before its first event."""
        self.model_name, self.max_loras = model_name, max_loras
        for metric in (self.running, self.waiting, self.kv_usage, self.prompt_tokens,
                       self.generation_tokens, self.ttft, self.itl, self.e2e):
            metric.labels(model_name)
        for reason in FINISHED_REASONS:
            self.success.labels(model_name, reason)
        for tier in LOAD_TIERS:
            self.adapter_load.labels(model_name, tier)
        for tier in LOOKUP_TIERS:
            self.adapter_lookups.labels(model_name, tier)
        self.refresh(EngineSnapshot(adapters_per_tier={t: 0 for t in TIERS}))

    # ---- requests -----------------------------------------------------------------------
    def track(self, adapter: str | None, choices: int = 1) -> RequestTrack:
        """A recorder for one request of ``choices`` samples on ``adapter`` (None = the
        base model)."""
        return RequestTrack(self, adapter or self.model_name, choices)

    def adapter_loaded(self, tier: str, seconds: float) -> None:
        """An engine adapter-load observer (any thread)."""
        self.adapter_load.labels(self.model_name, tier).observe(seconds)

    # ---- gauges -------------------------------------------------------------------------
    def refresh(self, snap: EngineSnapshot) -> None:
        """Set the gauges from ``snap``. vllm:lora_requests_info keeps one sample: the
        latest lists, valued with the time of this update."""
        name = self.model_name
        self.running.labels(name).set(snap.num_running)
        self.waiting.labels(name).set(snap.num_waiting)
        self.kv_usage.labels(name).set(snap.kv_cache_usage)
        for tier, count in snap.adapters_per_tier.items():
            self.adapters_resident.labels(name, tier).set(count)
        for tier in LOOKUP_TIERS:  # the engine counts; the counter takes the increase
            count = snap.adapter_lookups.get(tier, 0)
            self.adapter_lookups.labels(name, tier).inc(count - self._lookups_seen.get(tier, 0))
            self._lookups_seen[tier] = count
        self.adapter_version.clear()  # unloaded adapters leave the family
        for adapter, version in snap.adapter_versions.items():
            self.adapter_version.labels(name, adapter).set(version)
        self.lora_info.clear()
        self.lora_info.labels(str(self.max_loras), ",".join(snap.waiting_adapters),
                              ",".join(snap.running_adapters)).set(time.time())

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestTrack:
    """One request's timings and token counts. TTFT runs from the track's creation (the
    request's arrival) to its first token; every later output adds one inter-token
    latency; prompt tokens count once, with the first token (the prefill is done). A
    request of n choices finishes (one count) when its last choice does."""

    def __init__(self, metrics: ServerMetrics, adapter: str, choices: int = 1):
        self.m = metrics
        self.adapter = adapter
        self.choices_left = max(1, choices)
        self.start = time.monotonic()
        self.last: float | None = None

    def observe(self, out: RequestOutput) -> None:
        m, name, now = self.m, self.m.model_name, time.monotonic()
        n = len(out.new_token_ids)
        if n:
            if self.last is None:
                m.ttft.labels(name).observe(now - self.start)
                m.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
                m.adapter_prompt_tokens.labels(name, self.adapter).inc(len(out.prompt_token_ids))
            else:
                m.itl.labels(name).observe(now - self.last)
            self.last = now
            m.generation_tokens.labels(name).inc(n)
            m.adapter_generation_tokens.labels(name, self.adapter).inc(n)
        if out.finished and out.finish_reason in VLLM_REASON:
            self.choices_left -= 1
            if self.choices_left == 0:
                self.finish(VLLM_REASON[out.finish_reason])

    def finish(self, reason: str) -> None:
        """The request ended (``reason`` is one of FINISHED_REASONS)."""
        name = self.m.model_name
        self.m.success.labels(name, reason).inc()
        self.m.adapter_requests.labels(name, self.adapter, reason).inc()
        self.m.e2e.labels(name).observe(time.monotonic() - self.start)
