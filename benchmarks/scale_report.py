"""The scale benchmark's targets and tables (benchmarks/scale.py): the largest-n / smallest-n
ratios per (max-loras, α) against their targets, and one row per run with the adapter
cache's figures."""

from __future__ import annotations

from collections.abc import Sequence

from ..bench.report import fmt, table
from .cache_metrics import LOAD_TIERS, LOOKUP_TIERS

TARGETS = {"output_throughput": (">=", 0.95), "ttft_p50": ("<=", 1.5), "ttft_p99": ("<=", 1.5)}
METRIC_NAMES = {"output_throughput": "throughput", "ttft_p50": "TTFT p50",
                "ttft_p99": "TTFT p99"}


def _metric(run: dict, name: str) -> float:
    m = run["metrics"]
    return {"output_throughput": m["output_throughput"], "ttft_p50": m["ttft_ms"]["median"],
            "ttft_p99": m["ttft_ms"]["p99"]}[name]


def target_rows(runs: Sequence[dict]) -> list[dict]:
    """Per (max-loras, α): each target metric at the largest n over the smallest n."""
    groups: dict[tuple[str, float], dict[int, dict]] = {}
    for r in runs:
        groups.setdefault((r["max_loras"], r["alpha"]), {})[r["num_adapters"]] = r
    rows = []
    for (max_loras, alpha), by_n in groups.items():
        small, large = min(by_n), max(by_n)
        if small == large:
            continue
        for name, (op, bound) in TARGETS.items():
            lo, hi = _metric(by_n[small], name), _metric(by_n[large], name)
            ratio = hi / lo if lo > 0 else None  # None: nothing completed at the small n
            met = ratio is not None and (ratio >= bound if op == ">=" else ratio <= bound)
            rows.append({"max_loras": max_loras, "alpha": alpha, "metric": name,
                         "n_small": small, "n_large": large, "small": lo, "large": hi,
                         "ratio": ratio, "target": f"{op} {bound:g}", "met": bool(met)})
    return rows


def headline(row: dict) -> str:
    return (f"{METRIC_NAMES[row['metric']]} n={row['n_large']} / n={row['n_small']}, "
            f"α={row['alpha']:g}, max-loras={row['max_loras']}: **{fmt(row['ratio'], 2)}** "
            f"(target {row['target']}: {'met' if row['met'] else 'NOT met'})")


def _per_tier(values: dict | None, tiers: Sequence[str], digits: int = 1,
              percent: bool = False) -> str:
    """"a / b / c" over ``tiers``; "-" for a missing value, or when ``values`` is None."""
    if values is None:
        return "-"
    return " / ".join("-" if values.get(t) is None else
                      f"{100 * values[t]:.0f}%" if percent else fmt(values[t], digits)
                      for t in tiers)


def max_loras_cell(run: dict) -> str:
    """The value given, with what the server made of it where that differs ("auto (24)")."""
    given, actual = run["max_loras"], run.get("server", {}).get("max_loras")
    return given if actual is None or str(actual) == given else f"{given} ({actual})"


def scale_table(runs: Sequence[dict]) -> str:
    header = ["max-loras", "α", "n", "ok/failed", "req/s", "out tok/s", "TTFT p50",
              "TTFT p99", "TPOT p50", "TPOT p99", "E2E p50", "E2E p99",
              "hit " + "/".join(LOOKUP_TIERS), "loads/s " + "/".join(LOAD_TIERS),
              "load ms " + "/".join(LOAD_TIERS)]
    rows = []
    for r in runs:
        m, c = r["metrics"], r["cache"]
        rows.append([max_loras_cell(r), f"{r['alpha']:g}", str(r["num_adapters"]),
                     f"{m['completed']}/{m['failed']}", fmt(m["request_throughput"], 2),
                     fmt(m["output_throughput"]), fmt(m["ttft_ms"]["median"]),
                     fmt(m["ttft_ms"]["p99"]), fmt(m["tpot_ms"]["median"]),
                     fmt(m["tpot_ms"]["p99"]), fmt(m["e2el_ms"]["median"]),
                     fmt(m["e2el_ms"]["p99"]),
                     _per_tier(c["hit_rate"], LOOKUP_TIERS, percent=True),
                     _per_tier(c["loads_per_s"], LOAD_TIERS, 2),
                     _per_tier(c["load_ms_mean"], LOAD_TIERS, 2)])
    return table(header, rows)


def memory_table(runs: Sequence[dict]) -> str:
    """The server's resident memory with n adapters registered (before any was read) and
    after the run, beside the LoRA pool and a full host tier (max_cpu_loras × adapter)."""
    mib = 1 << 20
    rows = []
    for r in runs:
        s = r["server"]
        if "rss_start_bytes" not in s:
            continue
        host_tier = s["max_cpu_loras"] * s["adapter_bytes"]
        rows.append([max_loras_cell(r), f"{r['alpha']:g}", str(r["num_adapters"]),
                     fmt(s["rss_start_bytes"] / mib), fmt(s["rss_end_bytes"] / mib),
                     fmt((s["rss_end_bytes"] - s["rss_start_bytes"]) / mib),
                     fmt(s["lora_pool_bytes"] / mib), fmt(host_tier / mib)])
    return table(["max-loras", "α", "n", "RSS registered MiB", "RSS after MiB", "growth MiB",
                  "LoRA pool MiB", "max_cpu_loras × adapter MiB"], rows)


def targets_table(rows: Sequence[dict]) -> str:
    if not rows:
        return "(no ratios: they need at least two adapter counts)"
    out = [[r["max_loras"], f"{r['alpha']:g}", METRIC_NAMES[r["metric"]],
            f"{fmt(r['small'])} (n={r['n_small']})", f"{fmt(r['large'])} (n={r['n_large']})",
            fmt(r["ratio"], 2), r["target"], "yes" if r["met"] else "**no**"]
           for r in rows]
    return table(["max-loras", "α", "metric", "small n", "large n", "ratio large/small",
                  "target", "met"], out)


def run_line(run: dict) -> str:
    """One line as a run ends (progress)."""
    m, c, s = run["metrics"], run["cache"], run["server"]
    return (f"[{run['label']}] server {s['dtype']}, max_loras {s['max_loras']}, up in "
            f"{s['start_s']} s | {m['completed']}/{run['num_requests']} ok, "
            f"{m['request_throughput']:.2f} req/s, {m['output_throughput']:.1f} tok/s, TTFT "
            f"p50/p99 {m['ttft_ms']['median']:.0f}/{m['ttft_ms']['p99']:.0f} ms | loads "
            f"host/device {c['loads']['host']}/{c['loads']['device']}")
