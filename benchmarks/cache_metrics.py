"""The adapter cache as a benchmark sees it: the server's Prometheus ``/metrics`` (its
``--http-port``) scraped before and after a run, and the deltas.

- ``loraplex:adapter_load_seconds{tier}`` (histogram): ``_count`` = loads, ``_sum`` = their
  time; tier ``host`` = disk -> host memory, ``device`` = host -> device slot.
- ``loraplex:adapter_lookups_total{tier}`` (counter, where each request's adapter was found
  when it arrived: ``device``, ``host`` or ``disk``): the hit rate per tier. A server
  without it gives loads only (``hit_rate`` None).
"""

from __future__ import annotations

import urllib.request

LOAD = "loraplex:adapter_load_seconds"
LOOKUPS = "loraplex:adapter_lookups_total"
LOAD_TIERS = ("host", "device")
LOOKUP_TIERS = ("device", "host", "disk")

Samples = dict[str, dict[str, float]]  # sample name -> tier label ("" if none) -> value


def parse(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, summed over its labels but ``tier``
    (so the ``model_name`` label does not matter); histogram buckets and ``_created``
    timestamps are left out."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_created", "_bucket")):
                continue
            tiers = out.setdefault(s.name, {})
            tier = s.labels.get("tier", "")
            tiers[tier] = tiers.get(tier, 0.0) + s.value
    return out


def scrape(http_target: str, timeout_s: float = 10.0) -> Samples:
    """``GET http://HOST:PORT/metrics``, parsed."""
    with urllib.request.urlopen(f"http://{http_target}/metrics", timeout=timeout_s) as r:
        return parse(r.read().decode())


def _delta(before: Samples, after: Samples, name: str, tiers: tuple[str, ...]
           ) -> dict[str, float]:
    b, a = before.get(name, {}), after.get(name, {})
    return {t: a.get(t, 0.0) - b.get(t, 0.0) for t in tiers}


def cache_stats(before: Samples, after: Samples, duration_s: float) -> dict:
    """What happened in the cache between two scrapes ``duration_s`` apart: loads, loads/s
    and load time (total s, mean ms) per load tier; lookups and hit rates (fractions of the
    lookups) per lookup tier, or None where the server has no lookups counter."""
    if duration_s <= 0:
        raise ValueError(f"duration_s={duration_s} must be > 0")
    loads = _delta(before, after, f"{LOAD}_count", LOAD_TIERS)
    seconds = _delta(before, after, f"{LOAD}_sum", LOAD_TIERS)
    out: dict = {
        "loads": {t: round(v) for t, v in loads.items()},
        "loads_per_s": {t: v / duration_s for t, v in loads.items()},
        "load_s": seconds,
        "load_ms_mean": {t: 1e3 * seconds[t] / loads[t] if loads[t] else None
                         for t in LOAD_TIERS},
        "lookups": None, "hit_rate": None,
    }
    if LOOKUPS in after:
        lookups = _delta(before, after, LOOKUPS, LOOKUP_TIERS)
        total = sum(lookups.values())
        out["lookups"] = {t: round(v) for t, v in lookups.items()}
        out["hit_rate"] = {t: v / total if total else None for t, v in lookups.items()}
    return out
