"""EngineSnapshot: what the gauges of /metrics read from the engine, taken on the engine
thread between steps (``AsyncEngine.run``), so no asyncio code reads engine state while a
step changes it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..engine.llm_engine import LLMEngine

# AdapterInfo.state -> the tier it lives in ("resident adapters per tier")
TIER_OF_STATE = {"ON_DEVICE": "device", "ON_CPU": "host", "LOADING": "disk", "ON_DISK": "disk",
                 "FAILED": "failed"}
TIERS = ("device", "host", "disk", "failed")
LOOKUP_TIERS = ("device", "host", "disk")  # where a request found its adapter


@dataclass(frozen=True)
class EngineSnapshot:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # used / total KV blocks, in [0, 1]
    running_adapters: tuple[str, ...] = ()  # sorted, unique; the base model is not listed
    waiting_adapters: tuple[str, ...] = ()
    adapters_per_tier: dict[str, int] = field(default_factory=dict)  # every TIERS key
    # requests by where their adapter was when they arrived (device, host, disk), ever
    adapter_lookups: dict[str, int] = field(default_factory=dict)
    adapter_versions: dict[str, int] = field(default_factory=dict)  # registered name -> version


def take_snapshot(engine: LLMEngine) -> EngineSnapshot:
    """Call on the engine thread only."""
    stats = engine.stats()
    total = stats["kv_blocks_total"]
    running, waiting = engine.adapters_in_use()
    adapters = engine.list_adapters()
    tiers = Counter(TIER_OF_STATE.get(a.state, "disk") for a in adapters)
    return EngineSnapshot(
        num_running=stats["num_running"], num_waiting=stats["num_waiting"],
        kv_cache_usage=stats["kv_blocks_used"] / total if total else 0.0,
        running_adapters=tuple(running), waiting_adapters=tuple(waiting),
        adapters_per_tier={t: tiers.get(t, 0) for t in TIERS},
        adapter_lookups={t: engine.lora.counts[f"lookups_{t}"] for t in LOOKUP_TIERS},
        adapter_versions={a.name: a.version for a in adapters})
