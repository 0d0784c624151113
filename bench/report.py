"""Benchmark reports: markdown tables and PNG plots (matplotlib, Agg) from a results dict.

A results dict is ``{"title", "config": {...}, "runs": [run, ...], "sections"?, ...}`` where each run is
what ``serving.measure`` returns (``label``, ``num_adapters``, ``max_concurrency``,
``metrics``, ``per_adapter``, ``requests``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL"))


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def runs_table(runs: Sequence[dict]) -> str:
    """One row per run: throughputs, then latency mean/median/p99 (ms)."""
    header = ["run", "adapters", "conc.", "ok/failed", "req/s", "out tok/s", "total tok/s",
              "TTFT mean", "TTFT p50", "TTFT p99", "TPOT mean", "TPOT p50", "TPOT p99",
              "ITL p50", "E2EL p50", "E2EL p99", "goodput req/s"]
    rows = []
    for run in runs:
        m = run["metrics"]
        rows.append([run["label"], str(run["num_adapters"]), str(run["max_concurrency"] or "∞"),
                     f"{m['completed']}/{m['failed']}", fmt(m["request_throughput"], 2),
                     fmt(m["output_throughput"]), fmt(m["total_token_throughput"]),
                     fmt(m["ttft_ms"]["mean"]), fmt(m["ttft_ms"]["median"]),
                     fmt(m["ttft_ms"].get("p99")), fmt(m["tpot_ms"]["mean"]),
                     fmt(m["tpot_ms"]["median"]), fmt(m["tpot_ms"].get("p99")),
                     fmt(m["itl_ms"]["median"]), fmt(m["e2el_ms"]["median"]),
                     fmt(m["e2el_ms"].get("p99")), fmt(m.get("goodput"), 2)])
    return table(header, rows)


def sweep_table(runs: Sequence[dict]) -> str:
    """The knee: throughput with p50/p99 TTFT and TPOT per concurrency level."""
    header = ["concurrency", "adapters", "req/s", "out tok/s", "TTFT p50", "TTFT p99",
              "TPOT p50", "TPOT p99"]
    rows = [[str(r["max_concurrency"] or "∞"), str(r["num_adapters"]),
             fmt(r["metrics"]["request_throughput"], 2), fmt(r["metrics"]["output_throughput"]),
             fmt(r["metrics"]["ttft_ms"]["median"]), fmt(r["metrics"]["ttft_ms"].get("p99")),
             fmt(r["metrics"]["tpot_ms"]["median"]), fmt(r["metrics"]["tpot_ms"].get("p99"))]
            for r in runs]
    return table(header, rows)


def adapter_table(run: dict, limit: int = 12) -> str:
    """The busiest ``limit`` adapters of a run (\"\" shows as (base))."""
    items = sorted(run["per_adapter"].items(), key=lambda kv: -kv[1]["completed"])[:limit]
    rows = [[name or "(base)", str(m["completed"] + m["failed"]), fmt(m["output_throughput"]),
             fmt(m["ttft_ms"]["median"]), fmt(m["ttft_ms"].get("p99")),
             fmt(m["tpot_ms"]["median"]), fmt(m["e2el_ms"]["median"])]
            for name, m in items]
    return table(["adapter", "requests", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
                   "E2EL p50"], rows)


def _values(run: dict, key: str) -> np.ndarray:
    reqs = [r for r in run["requests"] if r["success"]]
    if key == "itl_ms":
        return np.asarray([g for r in reqs for g in r["itl_ms"]], dtype=float)
    return np.asarray([r[key] for r in reqs if r[key] is not None], dtype=float)


def plot_cdfs(runs: Sequence[dict], path: Path) -> Path:
    """Empirical CDFs of TTFT, TPOT, ITL and E2EL, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, name) in zip(axes.flat, LATENCIES):
        for run in runs:
            v = np.sort(_values(run, key))
            if v.size:
                ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=run["label"])
        ylabel = "fraction of gaps" if key == "itl_ms" else "fraction of requests"
        ax.set(title=f"{name} CDF", xlabel=f"{name} (ms)", ylabel=ylabel, ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_vs_adapters(runs: Sequence[dict], path: Path,
                     extra: Sequence[tuple[str, float]] = (),
                     series: Callable[[dict], str] | None = None,
                     ttft: Sequence[str] = ("median", "p99")) -> Path | None:
    """Output throughput and TTFT (``ttft``: "median", "p99", ...) against the number of
    adapters; ``extra`` adds horizontal reference lines (label, tok/s), e.g. base-only and
    PEFT; ``series`` names the line a run belongs to (one line per name, one colour each).
    None if fewer than two adapter counts."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        if r["num_adapters"] > 0:  # 0: base only
            groups.setdefault(series(r) if series else "", []).append(r)
    if len({r["num_adapters"] for g in groups.values() for r in g}) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (name, group) in enumerate(groups.items()):
        by_n = {r["num_adapters"]: r for r in group}
        ns = sorted(by_n)
        m = [by_n[n]["metrics"] for n in ns]
        color = f"C{i}" if series else None
        left.plot(ns, [x["output_throughput"] for x in m], "o-", color=color,
                  label=name or "loraplex, n adapters")
        for q, style in zip(ttft, ("o-", "s--", "^:")):
            q_name = "p50" if q == "median" else q
            right.plot(ns, [x["ttft_ms"].get(q, np.nan) for x in m], style, color=color,
                       label=f"{name} TTFT {q_name}".strip())
    for label, tps in extra:
        left.axhline(tps, ls="--", lw=1, color="C1" if "PEFT" in label else "C2", label=label)
    ns = sorted({r["num_adapters"] for g in groups.values() for r in g})
    left.set(title="output throughput", xlabel="adapters", ylabel="tokens/s", xscale="log",
             ylim=(0, None))
    right.set(title="time to first token", xlabel="adapters", ylabel="ms", xscale="log",
              ylim=(0, None))
    for ax in (left, right):
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(result: dict, plots: Sequence[Path] = ()) -> str:
    """The summary: settings, the runs table, the concurrency sweep, per-adapter tables."""
    runs = result["runs"]
    parts = [f"# {result.get('title', 'loraplex serving benchmark')}", ""]
    parts += [*(f"- {line}" for line in result.get("headline", [])), ""]
    config = result.get("config", {})
    if config:
        parts += ["```", *(f"{k}: {v}" for k, v in config.items()), "```", ""]
    legend = ("Latencies in ms (TTFT, TPOT = (E2EL − TTFT)/(output − 1), ITL, E2EL), "
              "throughputs per second, as in vLLM benchmark_serving.")
    parts += [legend, "", runs_table(runs), ""]
    for title, text in result.get("sections", []):
        parts += [f"## {title}", "", text, ""]
    if len({r["max_concurrency"] for r in runs}) > 1:
        parts += ["## Concurrency sweep", "", sweep_table(runs), ""]
    for plot in plots:
        parts += [f"![{plot.stem}]({plot.name})", ""]
    for run in runs:
        parts += [f"## Per adapter: {run['label']}", "", adapter_table(run), ""]
    return "\n".join(parts)


def write(result: dict, out_dir: Path, stem: str,
          extra_lines: Sequence[tuple[str, float]] = (),
          series: Callable[[dict], str] | None = None,
          ttft: Sequence[str] = ("median", "p99")) -> dict[str, Path]:
    """``<stem>.json``, ``<stem>.md`` and the PNG plots under ``out_dir``; their paths.
    ``result["sections"]`` ([title, markdown] pairs) follow the runs table; ``series`` and
    ``ttft`` go to ``plot_vs_adapters``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "markdown": out_dir / f"{stem}.md"}
    paths["json"].write_text(json.dumps(result, indent=1))
    plots = [plot_cdfs(result["runs"], out_dir / f"{stem}-latency-cdf.png")]
    vs = plot_vs_adapters(result["runs"], out_dir / f"{stem}-vs-adapters.png", extra_lines,
                          series, ttft)
    if vs is not None:
        plots.append(vs)
    for p in plots:
        paths[p.stem] = p
    paths["markdown"].write_text(markdown(result, plots))
    return paths
