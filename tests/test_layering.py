"""The package's layers: imports point one way (errors, flag, kernels ← lora, structured ←
engine ← server), no module imports itself back through others, nothing below cli.py parses flags,
the backends stand apart, the front-neutral server layer speaks no gRPC, and the engine runs
with kernel_backends/cpu deleted."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]  # the repository root is the package `loraplex`
PACKAGES = ["kernel_backends", "lora", "structured", "engine", "server", "proto", "bench",
            "benchmarks", "client"]
LAYERS = {"errors": 0, "flag": 0, "kernel_backends": 1, "lora": 2, "structured": 2, "engine": 3,
          "server": 4}
# The modules that may parse flags: the command line (cli.py and the modules it owns), and
# the tools that are their own entry points (python -m loraplex.benchmarks.*, the client's
# health probe, the stubs' generator). The layers and the config tree never do: their
# settings are dataclass fields, and config_flags.py derives the flags from them.
FLAG_PARSERS = {"loraplex.cli", "loraplex.config_flags", "loraplex.serve_command",
                "loraplex.client.grpc_client", "loraplex.proto.generate"}
CONFIG_TREE = {"loraplex.flag", "loraplex.config", "loraplex.client.connection"}


def module_files() -> dict[str, Path]:
    """loraplex module name -> file, for the top-level modules and the sub-packages."""
    files = {f"loraplex.{p.stem}": p for p in ROOT.glob("*.py") if p.stem != "__init__"}
    files["loraplex"] = ROOT / "__init__.py"
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(("loraplex", *parts))] = path
    return files


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The loraplex modules ``name`` imports (anywhere in the file): ``from P import x``
    counts as importing P.x where that is a module, else P."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("loraplex")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("loraplex"):
                target = node.module
            else:
                continue
            subs = {f"{target}.{a.name}" for a in node.names} & known
            found |= subs or {target}
    return found & known


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_imports_point_down_the_layers(graph: dict[str, set[str]]) -> None:
    upward = [(m, dep) for m, deps in graph.items() for dep in deps
              if layer(m) is not None and layer(dep) is not None and layer(dep) > layer(m)]
    assert not upward, f"imports up the layers (errors, kernels < lora < engine < server): {upward}"


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def parses_flags(path: Path) -> list[str]:
    """What in the file parses a command line: an argparse/optparse/getopt import, sys.argv."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        found += [n for n in names if n.split(".")[0] in ("argparse", "optparse", "getopt")]
        if isinstance(node, ast.Attribute) and node.attr == "argv" and \
                isinstance(node.value, ast.Name) and node.value.id == "sys":
            found.append("sys.argv")
    return found


def test_nothing_below_cli_parses_flags() -> None:
    """The config rule: flags are parsed on top (cli.py, config_flags.py, serve_command.py)
    or by a tool's own entry point, never by the layers or the config tree."""
    parsing = {m: found for m, path in module_files().items() if (found := parses_flags(path))}
    below = {m: f for m, f in parsing.items() if layer(m) is not None or m in CONFIG_TREE}
    assert not below, f"parses flags below cli.py: {below}"
    stray = {m: f for m, f in parsing.items()
             if m not in FLAG_PARSERS and not m.startswith(("loraplex.bench.",
                                                            "loraplex.benchmarks."))}
    assert not stray, f"parses flags outside cli.py and the tools: {stray}"
    assert {"loraplex.cli", "loraplex.config_flags"} <= set(parsing)  # the rule sees them


def test_backends_stand_apart(graph: dict[str, set[str]]) -> None:
    """The torch backend imports no other backend; nothing outside kernel_backends/cpu (and the
    tools in benchmarks/) imports it, so the folder can be deleted; the engine and the LoRA
    layers reach the kernels only through the interface and the selector."""
    def inside(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    cpu, triton, torch_ = "loraplex.kernel_backends.cpu", "loraplex.kernel_backends.triton", \
        "loraplex.kernel_backends.torch"
    for module, deps in graph.items():
        if inside(module, torch_):
            assert not any(inside(d, cpu) or inside(d, triton) for d in deps), module
        if not inside(module, cpu) and not inside(module, "loraplex.benchmarks"):
            assert not any(inside(d, cpu) for d in deps), (module, deps)
        if layer(module) in (2, 3, 4):
            backends = [d for d in deps if inside(d, cpu) or inside(d, triton)
                        or inside(d, torch_)]
            assert not backends, (module, backends)



def test_the_runtime_imports_no_benchmark_and_no_test() -> None:
    """benchmarks/ and tests/ are left out of the wheel: no module of the package (bench/, the
    command ``loraplex bench``, included) imports them; the benchmarks may import the package."""
    outside = ("loraplex.benchmarks", "loraplex.tests")
    files = module_files()
    for module, path in files.items():
        if module.startswith(outside):
            continue
        deps = imports_of(module, path, set(files) | set(outside))
        assert not [d for d in deps if d.startswith(outside)], (module, deps)
        assert not absolute_imports(path) & {"tests", "benchmarks"}, module
    assert "loraplex.bench.command" in files and "loraplex.benchmarks.scale" in files


def test_the_wheel_leaves_benchmarks_and_tests_out(graph: dict[str, set[str]]) -> None:
    """pyproject.toml's packages hold what `loraplex` imports (``loraplex bench`` included)
    and neither benchmarks/ nor tests/; no data of theirs is package data. (Building the
    wheel and listing it: the wheel test.)"""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(setuptools["packages"])
    assert not {p for p in packages if p.startswith(("loraplex.benchmarks", "loraplex.tests"))}
    excluded = setuptools["exclude-package-data"]["*"]
    assert {"benchmarks/*", "tests/*"} <= set(excluded)
    seen, todo = set(), ["loraplex.cli", "loraplex.bench.command", "loraplex.bench.flags"]
    while todo:  # everything the command line reaches, imported anywhere in its files
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += sorted(graph[module])
    unpackaged = {m for m in seen if m != "loraplex" and m.rpartition(".")[0] not in packages
                  and m not in packages}
    assert not unpackaged, f"imported by the command line but not in the wheel: {unpackaged}"


# The gRPC front (server/grpc/) and the composition root (loraplex_server.py): the only
# modules of server/, with server/ray/ (which fronts Ray's gRPC proxy), that may speak gRPC.
# Everything else in server/ (the front-neutral layer, and the HTTP front) raises ErrorCode,
# never a gRPC code.
GRPC_FRONT = {"loraplex.server.loraplex_server"} | {
    f"loraplex.server.grpc.{m}" for m in (
        "inference", "adapter_admin", "server_info", "status", "auth_interceptor", "health",
        "proto_convert", "response_messages", "adapter_upload", "upload_limits")}
GRPC_PACKAGES = ("grpc", "grpc_health", "grpc_reflection")


def absolute_imports(path: Path) -> set[str]:
    """The top-level packages a file imports by absolute name (anywhere in it)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_front_neutral_layer_speaks_no_grpc(graph: dict[str, set[str]]) -> None:
    """Below the fronts (generation, state, adapter_ops, ...) and in the HTTP front no
    module imports grpc, the proto stubs or a gRPC front module: errors carry an ErrorCode
    (server/error_code.py) that each front maps."""
    files = module_files()
    neutral = [m for m in files if m.startswith("loraplex.server.")
               and m not in GRPC_FRONT and m != "loraplex.server.grpc"
               and not m.startswith("loraplex.server.ray")]
    assert {"loraplex.server.generation", "loraplex.server.state",
            "loraplex.server.adapter_ops", "loraplex.server.http.error_bodies"} <= set(neutral)
    speaking = {m: sorted(absolute_imports(files[m]) & set(GRPC_PACKAGES)
                          | {d for d in graph[m] if d in GRPC_FRONT
                             or d.startswith("loraplex.proto")})
                for m in neutral}
    leaks = {m: s for m, s in speaking.items() if s}
    assert not leaks, f"front-neutral modules speak gRPC: {leaks}"
    assert set(GRPC_FRONT) <= set(files), sorted(set(GRPC_FRONT) - set(files))


def _copy_without_cpu_kernels(dest: Path) -> Path:
    package = dest / "loraplex"
    package.mkdir()
    for path in ROOT.glob("*.py"):
        shutil.copy(path, package / path.name)
    for sub in PACKAGES:
        shutil.copytree(ROOT / sub, package / sub,
                        ignore=shutil.ignore_patterns("__pycache__", "results", "*.png"))
    shutil.rmtree(package / "kernel_backends" / "cpu")
    return package


@pytest.mark.parametrize("module", ["loraplex.client", "loraplex.client.grpc_client",
                                    "loraplex.server.ray.registry",
                                    "loraplex.server.ray.registry_store"])
def test_light_modules_load_no_torch(module: str) -> None:
    """The client, and the Ray adapter registry's actor (a process of its own, which holds
    only names and paths), start without torch: with it the registry actor alone held
    ~570 MiB of the two-replica Ray deployment's memory."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_the_engine_runs_with_kernels_cpu_deleted(tiny_llama: Path, tmp_path: Path) -> None:
    """A copy of the package without kernel_backends/cpu serves on the torch backend, exact."""
    package = _copy_without_cpu_kernels(tmp_path)
    prompt, new = [5, 17, 42, 99, 7, 3], 6
    script = (
        "import loraplex, json\n"
        "from loraplex import LLMEngine, SamplingParams\n"
        f"engine = LLMEngine(model={str(tiny_llama)!r}, dtype='float32', max_model_len=64)\n"
        f"out = engine.generate([{prompt}], SamplingParams(temperature=0.0, "
        f"max_new_tokens={new}, min_new_tokens={new}))[0]\n"
        "print(json.dumps([loraplex.__file__, engine.base.kernels.name, out.token_ids]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LORAPLEX_KERNELS"}
    env["PYTHONPATH"] = str(tmp_path)
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    where, backend, tokens = json.loads(run.stdout.strip().splitlines()[-1])
    assert where.startswith(str(package)) and backend == "torch"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    want = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert tokens == want
