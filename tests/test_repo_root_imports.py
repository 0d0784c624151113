"""The repository root is the package ``loraplex`` (package-dir "." in pyproject.toml), and
``python -m ...`` or ``python -m pytest`` run from it put that directory first on sys.path:
every subpackage there is then also importable as a top-level module. A dependency that
imports a top-level module of the same name gets ours instead (transformers 5.25 imports
the hub's ``kernels`` package, which our ``kernels/`` shadowed until it became
``kernel_backends/``). Invariant: with the root first on sys.path, importing what a server
imports loads none of the root's entries as a top-level module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# what `loraplex serve` (with --ray) and the benchmarks' baselines pull in
IMPORTS = ["loraplex.serve_command", "loraplex.engine.llm_engine",
           "loraplex.server.loraplex_server", "transformers", "transformers.modeling_utils",
           "peft", "ray.serve", "xgrammar"]


def root_entries() -> set[str]:
    names = {p.stem for p in ROOT.glob("*.py")}
    names |= {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    return names - {"__init__"}


def test_dependencies_import_none_of_the_root_as_top_level_modules() -> None:
    code = ("import importlib, json, sys\n"
            f"for name in {IMPORTS!r}: importlib.import_module(name)\n"
            "print(json.dumps(sorted(sys.modules)))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, check=False,
                         text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    loaded = {name.split(".")[0] for name in json.loads(run.stdout.splitlines()[-1])}
    shadowed = sorted(loaded & root_entries())
    assert not shadowed, (f"{shadowed} imported as top-level modules from the repository "
                          "root: rename them (a dependency imports a package of that name)")
