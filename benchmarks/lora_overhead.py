"""What multi-LoRA costs, measured in an order that cannot hide a state one run leaves behind.

    .venv/bin/python -m loraplex.benchmarks.lora_overhead [--dtype auto] [--adapters 32]
        [--rounds 3] [--processes 1] [--peft-rounds 1] [--out benchmarks/results/DATE-lora-overhead]
        [--batch-invariant auto|on|off]

SmolLM2-135M, 32 requests x 64 prompt x 32 new tokens, greedy, random rank-8 adapters on
all seven targets; output tokens/s of ``LLMEngine.generate`` (the median of ``--rounds``):
(a) the base model, (b) one adapter for every request, (c) ``--adapters`` distinct
adapters in the batch; and the baselines, HF ``generate`` on the base model and PEFT's
mixed-adapter ``generate`` on the same requests.

Every figure comes from a fresh process (the baselines too), and the engine runs twice:
- order "base first": (a) before any adapter was ever read, then (c), (b), then (a) again;
- order "adapters first": (c) first, then (b), then (a).
So the base is measured clean (first, in its own process) and after adapters were served,
and (c) both first and after the base. ``--processes N`` runs the HF and engine processes N
times, interleaved (HF, base first, adapters first, HF, ...), and pools their rounds: on a
shared machine a whole process may run ~10 % slow, which one process per figure cannot
tell from a state one phase leaves behind (PEFT, far from its target, runs once).

It prints the ratios against their targets, and the budget that base / HF >= 2 leaves a
decode step: the fresh base's and HF's prefill are also timed alone (one new token), and
where HF's prefill runs the same GEMMs at the cores' peak, the decode alone must make up
the factor. It fails (exit 1) when the base after adapters runs below 0.95 of the base
before them: that is a process-wide slowdown left behind by serving adapters
(benchmarks/results/2026-12-02-omp-pools.md). ``--out`` writes the figures as JSON and a
Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .common import (
    add_engine_flags,
    default_model_dir,
    machine_line,
    make_random_adapters,
    random_prompts,
)

ORDERS = {"base first": ["a", "c", "b", "a_after"], "adapters first": ["c", "b", "a_after"]}
PHASE_NAMES = {"a": "(a) base", "b": "(b) one adapter", "c": "(c) distinct adapters",
               "a_after": "(a) base, after adapters"}
MIN_BASE_AFTER = 0.95  # base after adapters / base before: below this, exit 1
TARGETS = {"c / base": 0.85, "base / HF": 2.0, "c / PEFT": 5.0}


# ---- children: one fresh process each -----------------------------------------------------
def engine_phases(model_dir: Path, adapters: dict[str, Path], prompts: list[list[int]],
                  dtype: str, order: list[str], rounds: int, new_tokens: int,
                  max_model_len: int = 1024, batch_invariant: str = "auto") -> dict:
    """Output tok/s per phase, in ``order``. The engine registers the adapters but reads
    none before the first phase that uses them; each phase starts with one untimed short
    generate of its own requests (adapters made resident), then ``rounds`` timed ones."""
    from .. import LLMEngine, SamplingParams
    from ..engine.engine_config import EngineConfig

    n = len(prompts)
    # every request in one batch, every adapter on the device (no swaps inside a timed
    # phase), the adapters' rank, no prefix cache (rounds repeat their prompts); else the
    # engine's defaults
    engine = LLMEngine.from_config(EngineConfig(
        model=str(model_dir), dtype=dtype, max_num_seqs=n, max_model_len=max_model_len,
        max_lora_rank=8, max_loras=len(adapters), max_cpu_loras=len(adapters),
        enable_prefix_caching=False, lora_modules={k: str(p) for k, p in adapters.items()},
        batch_invariant=batch_invariant))
    names = list(adapters)
    per_phase = {"a": [None] * n, "a_after": [None] * n, "b": [names[0]] * n, "c": names}
    warm = SamplingParams(temperature=0.0, max_new_tokens=2)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    prefill = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    tps: dict[str, list[float]] = {}
    adapters_read_before: dict[str, int] = {}
    out: dict = {}
    for phase in order:
        adapters_read_before[phase] = engine.stats()["adapters_in_host"]
        engine.generate([p[:8] for p in prompts], warm, adapters=per_phase[phase])
        tps[phase] = [_timed_tps(lambda names=per_phase[phase]: engine.generate(
            prompts, params, adapters=names)) for _ in range(rounds)]
        if phase == "a":  # the fresh base's prefill alone (and its first token)
            out["prefill_s"] = [_seconds(lambda: engine.generate(prompts, prefill))
                                for _ in range(rounds)]
    return {**out, "tps": tps, "adapters_read_before": adapters_read_before,
            "shape": {"requests": n, "new_tokens": new_tokens},
            "machine": machine_line(engine.base.kernels.name,
                                    str(engine.base.dtype).removeprefix("torch."))
            + f" | --batch-invariant {batch_invariant}"}


def _timed_tps(run: Callable[[], list]) -> float:
    start = time.perf_counter()
    outs = run()
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def _seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def hf_tps(model_dir: Path, prompts: list[list[int]], dtype: str, rounds: int,
           new_tokens: int) -> dict[str, list[float]]:
    """HF ``generate`` on the base model: output tok/s per round ("tps"), after one untimed
    round of the same shapes (oneDNN builds its kernels per shape on first use: a short
    warm-up left the first timed rounds at a tenth of HF's speed on a Xeon with AMX); then
    the seconds of its prefill alone, with one new token, per round ("prefill_s")."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        _hf_round(model, ids, new_tokens)
        tps = [_hf_round(model, ids, new_tokens) for _ in range(rounds)]
        prefill = [_hf_seconds(model, ids, 1) for _ in range(rounds)]
    return {"tps": tps, "prefill_s": prefill}


def _hf_round(model: object, ids: torch.Tensor, new_tokens: int, **kwargs: object) -> float:
    """Output tok/s of one greedy ``generate`` of exactly ``new_tokens`` a row."""
    return new_tokens * ids.shape[0] / _hf_seconds(model, ids, new_tokens, **kwargs)


def _hf_seconds(model: object, ids: torch.Tensor, new_tokens: int, **kwargs: object) -> float:
    return _seconds(lambda: model.generate(  # type: ignore[attr-defined]
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs))


def load_peft(model_dir: Path, adapters: dict[str, Path], dtype: str) -> object:
    """The base model with every adapter loaded into one PeftModel, in eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    items = list(adapters.items())
    model = PeftModel.from_pretrained(base, items[0][1], adapter_name=items[0][0])
    for name, path in items[1:]:
        model.load_adapter(path, adapter_name=name)
    return model.eval()


def peft_tps(model_dir: Path, adapters: dict[str, Path], prompts: list[list[int]],
             names: list[str], new_tokens: int, dtype: str, rounds: int) -> list[float]:
    """Output tok/s of PEFT's mixed-adapter batched greedy generate, once per round, after
    one untimed round (as HF's)."""
    model = load_peft(model_dir, adapters, dtype)
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        _hf_round(model, ids, new_tokens, adapter_names=names)
        return [_hf_round(model, ids, new_tokens, adapter_names=names) for _ in range(rounds)]


# ---- the parent: children in order, then the verdict --------------------------------------
def run_child(role: str, args: argparse.Namespace, dtype: str) -> dict:
    cmd = [sys.executable, "-m", "loraplex.benchmarks.lora_overhead", "--child", role,
           "--dtype", dtype, "--adapters", str(args.adapters), "--rounds", str(args.rounds),
           "--peft-rounds", str(args.peft_rounds), "--adapter-dir", str(args.adapter_dir),
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
           "--batch-invariant", args.batch_invariant]
    run = subprocess.run(cmd, capture_output=True, text=True, check=False)
    result = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode != 0 or not result:
        raise RuntimeError(f"child {role!r} failed ({run.returncode}): {run.stderr[-2000:]}")
    return json.loads(result[-1].removeprefix("RESULT "))


def child(role: str, args: argparse.Namespace) -> dict:
    model_dir = default_model_dir()
    adapters = make_random_adapters(model_dir, args.adapters, args.adapter_dir)
    prompts = random_prompts(args.adapters, args.prompt_len, vocab=49152, seed=2)
    if role == "hf":
        return hf_tps(model_dir, prompts, args.dtype, args.rounds, args.new_tokens)
    if role == "peft":
        return {"tps": peft_tps(model_dir, adapters, prompts, list(adapters), args.new_tokens,
                                args.dtype, args.peft_rounds)}
    return engine_phases(model_dir, adapters, prompts, args.dtype, ORDERS[role], args.rounds,
                         args.new_tokens, batch_invariant=args.batch_invariant)


def resolve_dtype(dtype: str) -> str:
    """``auto``: what the engine's ``--dtype auto`` serves the embedded (bf16) model in."""
    if dtype != "auto":
        return dtype
    from ..kernel_backends import select_backend

    backend = select_backend(torch.device("cpu"), torch.float32)
    return str(backend.auto_dtype(torch.bfloat16, torch.device("cpu"))).removeprefix("torch.")


def pooled(runs: list[dict]) -> dict:
    """One role's processes as one result: each phase's rounds, and the prefill's, in process
    order (so each median spans the processes); the first process's other fields."""
    out = dict(runs[0])
    tps = runs[0]["tps"]
    out["tps"] = {phase: [v for r in runs for v in r["tps"][phase]] for phase in tps} \
        if isinstance(tps, dict) else [v for r in runs for v in r["tps"]]
    if "prefill_s" in out:
        out["prefill_s"] = [v for r in runs for v in r["prefill_s"]]
    out["processes"] = len(runs)
    return out


def ratios(results: dict) -> dict[str, float]:
    med = {key: statistics.median(v) for key, v in _figures(results).items()}
    return {
        "base after / base before": med["a_after@base first"] / med["a@base first"],
        "base (adapters first) / base before": med["a_after@adapters first"] / med["a@base first"],
        "c / base (base first)": med["c@base first"] / med["a@base first"],
        "c / base (adapters first)": med["c@adapters first"] / med["a@base first"],
        "base / HF": med["a@base first"] / med["hf"],
        **({"c / PEFT": med["c@base first"] / med["peft"]} if "peft" in med else {}),
    }


def _figures(results: dict) -> dict[str, list[float]]:
    figures = {f"{phase}@{order}": v for order in ORDERS
               for phase, v in results[order]["tps"].items()}
    figures["hf"] = results["hf"]["tps"]
    if "peft" in results:
        figures["peft"] = results["peft"]["tps"]
    return figures


def decode_budget(results: dict) -> dict[str, float] | None:
    """Seconds of the base's and HF's prefill alone (medians), and the ms a decode step takes
    now against the most it may take for base / HF >= 2 (HF's run halved, less the engine's
    prefill, over the decode steps); None where the prefill was not timed."""
    base, hf = results["base first"], results["hf"]
    if "prefill_s" not in base or "prefill_s" not in hf:
        return None
    requests, new_tokens = base["shape"]["requests"], base["shape"]["new_tokens"]
    steps = max(new_tokens - 1, 1)
    engine_run = requests * new_tokens / statistics.median(base["tps"]["a"])
    hf_run = requests * new_tokens / statistics.median(hf["tps"])
    prefill = statistics.median(base["prefill_s"])
    return {"engine prefill s": prefill, "HF prefill s": statistics.median(hf["prefill_s"]),
            "decode step ms": (engine_run - prefill) / steps * 1e3,
            "decode step ms for base / HF = 2": (hf_run / 2 - prefill) / steps * 1e3}


def report(results: dict) -> list[str]:
    processes = results["base first"].get("processes", 1)
    lines = [results["base first"]["machine"],
             f"output tok/s (median of the rounds of {processes} process(es) each; rounds):"]
    for key, values in _figures(results).items():
        phase, _, order = key.partition("@")
        label = PHASE_NAMES.get(phase, {"hf": "HF generate", "peft": "PEFT mixed generate"}
                                .get(phase, phase)) + (f", order {order}" if order else "")
        lines.append(f"  {label:48s} {statistics.median(values):7.1f}   "
                     + " ".join(f"{v:.1f}" for v in values))
    for name, value in ratios(results).items():
        target = next((t for k, t in TARGETS.items() if name.startswith(k)),
                      MIN_BASE_AFTER if name.startswith("base (") or "after" in name else None)
        verdict = "" if target is None else f"  (target >= {target}: " \
                  f"{'met' if value >= target else 'MISSED'})"
        lines.append(f"{name:40s} {value:5.2f}{verdict}")
    budget = decode_budget(results)
    if budget is not None:
        lines.append(f"prefill alone (1 new token): engine {budget['engine prefill s']:.2f} s, "
                     f"HF {budget['HF prefill s']:.2f} s; a decode step: "
                     f"{budget['decode step ms']:.1f} ms, at most "
                     f"{budget['decode step ms for base / HF = 2']:.1f} ms for base / HF >= 2")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_flags(ap, "dtype", "batch_invariant")
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--processes", type=int, default=1,
                    help="fresh processes per engine order and for HF (their rounds pooled)")
    ap.add_argument("--peft-rounds", type=int, default=1, help="0: skip PEFT")
    ap.add_argument("--adapter-dir", type=Path, default=Path(tempfile.gettempdir()) /
                    "loraplex-bench-adapters")
    ap.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    ap.add_argument("--child", choices=[*ORDERS, "hf", "peft"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args)))
        return 0
    dtype = resolve_dtype(args.dtype)
    runs: dict[str, list[dict]] = {}
    for n in range(args.processes):  # interleaved: a slow spell hits every role alike
        for role in ["hf", *ORDERS, *(["peft"] if args.peft_rounds and n == 0 else [])]:
            runs.setdefault(role, []).append(run_child(role, args, dtype))
    results = {role: pooled(r) for role, r in runs.items()}
    lines = report(results)
    print("\n".join(lines))
    if args.out is not None:
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
        args.out.with_suffix(".md").write_text("```\n" + "\n".join(lines) + "\n```\n")
    after = ratios(results)["base after / base before"]
    if after < MIN_BASE_AFTER:
        print(f"FAILED: the base model runs at {after:.2f} of its speed after adapters were "
              f"served (< {MIN_BASE_AFTER}): something process-wide slowed down", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
