"""benchmarks/gpu_check.sh gives a verdict: its CPU dry run (interpreter, tiny shapes) passes, a
missing pytest fails it, and benchmarks/kernels.py's verdict fails on a mismatch or a NaN."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from loraplex.benchmarks.kernels import Verdict, summary

ROOT = Path(__file__).resolve().parents[1]


def run_check(tmp_path: Path, python: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(tmp_path / "logs"), "PYTHON": python}
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"],
                          env=env, capture_output=True, text=True, timeout=600, check=False)


def test_dry_run_passes(tmp_path: Path) -> None:
    run = run_check(tmp_path, sys.executable)
    last = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert last.startswith("gpu_check: PASS | % of HBM roofline: shrink=")
    for kernel in ("expand", "decode", "prefill", "store_kv", "w4a16"):
        assert f"{kernel}=" in last
    assert "| batch-invariant mode: PASS | invariant/default: linear≤" in last


def test_missing_pytest_fails(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "pytest.py").write_text("raise ImportError('no pytest here')\n")
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{shadow}" exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    run = run_check(tmp_path, str(wrapper))
    assert run.returncode == 1
    assert run.stdout.strip().splitlines()[-1].startswith("gpu_check: FAIL | pytest is not")


def test_verdict_fails_on_mismatch_and_nan() -> None:
    verdict = Verdict()
    verdict.check("same", torch.ones(4), torch.ones(4))
    verdict.record("shrink", 40.0)
    assert summary(verdict, {"shrink": 0}).startswith("PASS")
    verdict.check("off", torch.ones(4), torch.zeros(4))
    verdict.check("nan", torch.tensor([float("nan")]), torch.zeros(1))
    assert [f.split(":")[0] for f in verdict.failures] == ["off", "nan"]
    assert summary(verdict, None).startswith("FAIL")
    assert summary(Verdict(), {"expand": 12}).startswith("FAIL") and "expand=12" in summary(
        Verdict(), {"expand": 12})
