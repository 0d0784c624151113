"""The built wheel, as a user installs it: ``pip wheel`` of a copy of the checkout (so that no
stale build/ of the checkout leaks into it, and the checkout stays clean), its file list (the
demo adapters in, no tests and no benchmark results), and the wheel installed in a fresh
venv that sees this environment's dependencies but not the checkout: the installed package
finds its demo adapters, and ``loraplex serve`` from it lists them and one answers (20-35 s
on 2 cores with the embedded model converted, which test_demo_adapters.py needs too).
Without --model, missing demo adapters are a warning in the start-up log, never silence."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest
from loraplex import serve_command
from loraplex.cli import main

ROOT = Path(__file__).resolve().parents[1]
DEMO = ("caps", "json", "pirate")
DEMO_FILES = ("adapter_config.json", "adapter_model.safetensors")
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", ".whl", "build", "dist", "*.egg-info",
                                    "__pycache__", ".pytest_cache", ".ruff_cache",
                                    ".hypothesis")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip wheel --no-deps --no-build-isolation`` of a copy of the checkout (~2 s)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "loraplex"
    shutil.copytree(ROOT, src, ignore=NOT_SOURCE)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(tmp / "dist"), str(src)],
        capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (whl,) = (tmp / "dist").glob("loraplex-*.whl")
    return whl


def test_the_wheel_ships_the_demo_adapters_and_no_results(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        sizes = {i.filename: i.file_size for i in zf.infolist()}
    for name in DEMO:
        for file in DEMO_FILES:
            shipped = f"loraplex/adapters/{name}/{file}"
            assert shipped in sizes, f"{shipped} is not in the wheel"
            assert sizes[shipped] == (ROOT / "adapters" / name / file).stat().st_size
    assert "loraplex/kernel_backends/cpu/csrc/bindings.cpp" in sizes  # the CPU kernels' source
    assert "loraplex/cli.py" in sizes
    stray = [n for n in sizes if not n.startswith(("loraplex/", "loraplex-0.1.0.dist-info/"))
             or n.startswith(("loraplex/tests/", "loraplex/benchmarks/", "loraplex/bench/results/",
                              "loraplex/docs/"))]
    assert not stray, stray


def test_serve_warns_when_the_demo_adapters_are_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    """An install without adapters/ (as the wheel was before it shipped them) says so."""
    monkeypatch.setattr(serve_command, "demo_adapters_dir", lambda: tmp_path / "adapters")
    monkeypatch.setattr(serve_command, "_serve", lambda config: 0)  # no model loads
    with caplog.at_level(logging.WARNING, logger="loraplex"):
        assert main(["serve", "--port", "0", "--device", "cpu"]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"no demo adapters in {tmp_path / 'adapters'}" in w for w in warnings), warnings


def test_serve_finds_the_demo_adapters_in_the_package(caplog: pytest.LogCaptureFixture) -> None:
    assert serve_command.demo_adapters_dir() == ROOT / "adapters"
    with caplog.at_level(logging.WARNING, logger="loraplex"):
        serve_command.warn_if_no_demo_adapters()
    assert not caplog.records


def fresh_venv(path: Path) -> Path:
    """A venv whose own site-packages comes first, then this environment's (a plain path in a
    .pth file: the .pth files there, the editable loraplex finder among them, are not run).
    Its python, which imports loraplex only from what is installed into it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   timeout=120)
    python = path / "bin" / "python"
    own = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (Path(own) / "_loraplex_test_deps.pth").write_text("".join(f"{p}\n" for p in ours))
    return python


def child_env() -> dict[str, str]:
    """This environment without the paths that would show it the checkout."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed (``pip install --no-deps``, no index) in a fresh venv: its root."""
    venv = tmp_path_factory.mktemp("installed") / "venv"
    python = fresh_venv(venv)
    done = subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q",
         str(wheel)], capture_output=True, text=True, env=child_env(), timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return venv


def test_the_installed_package_finds_its_demo_adapters(installed: Path, tmp_path: Path) -> None:
    """What ``serve`` registers without --model, asked of the installed package (not the
    checkout) from a foreign cwd."""
    probe = ("import loraplex, json; from loraplex.serve_command import demo_adapters_dir; "
             "from loraplex.server.lora_modules import demo_adapters; "
             "print(json.dumps([loraplex.__file__, demo_adapters(demo_adapters_dir())]))")
    out = subprocess.run([installed / "bin" / "python", "-c", probe], cwd=tmp_path,
                         capture_output=True, text=True, env=child_env(), timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    where, found = json.loads(out.stdout.splitlines()[-1])
    assert Path(where).is_relative_to(installed), where  # the wheel's copy, not the checkout
    assert sorted(found) == list(DEMO), found
    for path in found.values():
        assert Path(path).is_relative_to(installed), path


def test_the_installed_wheel_serves_the_demo_adapters(installed: Path, tmp_path: Path) -> None:
    from loraplex.client import Client
    from loraplex.engine.embedded_model import ensure_default_gguf

    ensure_default_gguf(progress=False)  # fetched once per machine, outside the timeout
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [installed / "bin" / "loraplex", "serve", "--host", "127.0.0.1", "--port", "0",
             "--device", "cpu", "--dtype", "float32", "--max-model-len", "256"],
            cwd=cwd, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while (port := re.search(r"listening on 127\.0\.0\.1:(\d+)", log_path.read_text())
               ) is None:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        with Client(f"127.0.0.1:{port[1]}") as client:
            client.wait_until_serving(timeout=120)
            names = {a.name for a in client.list_adapters()}
            assert set(DEMO) <= names, names
            reply = client.generate("What is the capital of Italy?", adapter="caps",
                                    apply_chat_template=True, temperature=0.0,
                                    max_new_tokens=48, timeout=120)
        letters = [c for c in reply.text if c.isalpha()]
        # caps answered (adapters/train.py's is_caps, as tests/test_demo_adapters.py checks)
        assert letters and sum(c.isupper() for c in letters) >= 0.9 * len(letters), reply.text
        text = log_path.read_text()
        assert "no demo adapters" not in text, text[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
