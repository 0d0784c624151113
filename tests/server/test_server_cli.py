"""The client side of the CLI against a real server: `loraplex generate --server`,
`loraplex adapters ...` errors, and the `python -m loraplex.client health` probe."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from loraplex import client as client_mod
from loraplex.cli import main

from tests.server.conftest import wait_until

ADMIN = "cli-admin"


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path) -> Any:
    return serve(lambda: make_engine(tiny_llama), admin_token=ADMIN)


# the server's only token guards every route but health (issue 42): generate sends it too
TOKEN = ["--admin-token", ADMIN]


def test_generate_through_server_streams_the_completion(capsys, server: Any) -> None:
    with server.client(admin_token=ADMIN) as c:
        expected = c.generate("the cat", temperature=0.0, max_new_tokens=8,
                              apply_chat_template=True).text
    assert main(["generate", "--server", server.target, "the cat", "--max-new-tokens", "8",
                 *TOKEN]) == 0
    assert capsys.readouterr().out == expected + "\n"
    with server.client(admin_token=ADMIN) as c:
        plain = c.generate("the cat", temperature=0.0, max_new_tokens=8).text
    assert main(["generate", "--server", server.target, "the cat", "--max-new-tokens", "8",
                 "--no-chat-template", *TOKEN]) == 0
    assert capsys.readouterr().out == plain + "\n"


@pytest.fixture(scope="module")
def long_server(serve, make_engine, tiny_llama: Path) -> Any:
    """The tiny model's whole context (512), so that 256 new tokens fit beside a prompt."""
    return serve(lambda: make_engine(tiny_llama, max_model_len=512))


def test_generate_stops_after_256_new_tokens_by_default(capsys, long_server: Any) -> None:
    """Issue 42, item 13: with no --max-new-tokens the CLI stops the request after 256 new
    tokens (it used to run to max_model_len); --max-new-tokens 0 lifts the cap, and a cap
    larger than the room left is not an error (the default applies client-side)."""
    with long_server.client() as c:
        capped = c.generate("the cat", temperature=0.0, max_new_tokens=256,
                            apply_chat_template=True)
        whole = c.generate("the cat", temperature=0.0, apply_chat_template=True)
    assert len(capped.token_ids) == 256 < len(whole.token_ids)  # the tiny model goes on
    assert main(["generate", "--server", long_server.target, "the cat"]) == 0
    assert capsys.readouterr().out == capped.text + "\n"
    assert main(["generate", "--server", long_server.target, "the cat",
                 "--max-new-tokens", "0"]) == 0
    assert capsys.readouterr().out == whole.text + "\n"
    engine = long_server.engine
    wait_until(lambda: not engine.requests and engine.block_manager.num_used_blocks == 0,
               what="the cancelled request freed")


def test_generate_default_fits_a_short_context(capsys, server: Any) -> None:
    """max_model_len 256: fewer than 256 tokens fit beside the prompt, and the default
    still runs (to the end of the context)."""
    with server.client(admin_token=ADMIN) as c:
        whole = c.generate("the cat", temperature=0.0, apply_chat_template=True)
    assert main(["generate", "--server", server.target, "the cat", *TOKEN]) == 0
    assert capsys.readouterr().out == whole.text + "\n"


def test_generate_through_server_reports_status(capsys, server: Any) -> None:
    assert main(["generate", "--server", server.target, "hi", "--adapter", "nope",
                 *TOKEN]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert main(["generate", "--server", server.target, "hi"]) == 1  # no token
    assert "UNAUTHENTICATED" in capsys.readouterr().err


@pytest.mark.parametrize("verb", [["list"], ["load", "x", "/tmp"], ["unload", "x"]])
def test_adapters_without_admin_token(capsys, server: Any, verb: list[str]) -> None:
    assert main(["adapters", *verb, "--server", server.target]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_health_probe(capsys, server: Any) -> None:
    assert client_mod.main(["health", "--server", server.target]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    assert client_mod.main(["health", "--server", "127.0.0.1:1", "--timeout", "0.5"]) == 2


# ---- adapters upload: the local directory, checked before the call (issue 42, item 12) --
def upload_cases(tmp: Path, good: Path) -> dict[str, tuple[Path, str]]:
    """case -> (the directory given, what the message says besides its path)."""
    def copy(name: str) -> Path:
        return Path(shutil.copytree(good, tmp / name))

    (tmp / "empty").mkdir()
    (tmp / "a-file").write_text("x")
    dangling = copy("dangling")
    (dangling / "adapter_config.json").unlink()
    (dangling / "adapter_config.json").symlink_to(tmp / "gone.json")
    (tmp / "dir-link").symlink_to(tmp / "no-such-dir")
    no_weights = copy("no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    pickle = copy("pickle")
    (pickle / "adapter_model.safetensors").rename(pickle / "adapter_model.bin")
    (copy("zero-weights") / "adapter_model.safetensors").write_bytes(b"")
    (copy("bad-json") / "adapter_config.json").write_text('{"r": 8,')
    (copy("json-list") / "adapter_config.json").write_text("[1, 2]")
    weights_dir = copy("weights-dir")
    (weights_dir / "adapter_model.safetensors").unlink()
    (weights_dir / "adapter_model.safetensors").mkdir()
    return {
        "missing": (tmp / "no-such", "no such directory"),
        "empty": (tmp / "empty", "has no adapter_config.json"),
        "a-file": (tmp / "a-file", "is a file"),
        "dangling-config": (dangling / "adapter_config.json", "is not readable (a symlink"),
        "dir-is-dangling-link": (tmp / "dir-link", "no such directory (a symlink"),
        "no-weights": (no_weights, "has no adapter_model.safetensors"),
        "pickle-only": (pickle, "adapter_model.bin (a pickle)"),
        "zero-weights": (tmp / "zero-weights" / "adapter_model.safetensors", "is empty"),
        "bad-json": (tmp / "bad-json" / "adapter_config.json", "is not readable JSON"),
        "json-list": (tmp / "json-list" / "adapter_config.json", "holds a JSON list"),
        "weights-is-a-dir": (weights_dir / "adapter_model.safetensors", "is a directory"),
    }


def _dir_of(case: str, path: Path) -> Path:
    """The directory the command gets for ``case`` (some cases name a file inside it)."""
    return path.parent if path.name.startswith("adapter_") else path


SUBPROCESS_CASES = ["missing", "empty", "a-file", "dangling-config"]


@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_adapters_upload_of_a_bad_directory_names_it(server: Any, tmp_path: Path,
                                                     tiny_adapters, case: str) -> None:
    """`loraplex adapters upload` as a process against a real server: a usage error (exit 2)
    that names the path and what is wrong, before any call; the server has no new adapter."""
    path, fragment = upload_cases(tmp_path, tiny_adapters("a0"))[case]
    run = subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "adapters", "upload", "bad",
         str(_dir_of(case, path)), "--server", server.target, "--admin-token", ADMIN],
        capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 2, run.stderr
    assert str(path) in run.stderr and fragment in run.stderr, run.stderr
    assert "Exception iterating requests" not in run.stderr
    with server.client(admin_token=ADMIN) as c:
        assert "bad" not in {a.name for a in c.list_adapters()}


def test_adapters_upload_checks_every_case_before_connecting(capsys, tmp_path: Path,
                                                            tiny_adapters) -> None:
    """Every case, in-process, with no server at all: the check comes before the call."""
    from loraplex.client import AdapterDirError, Client

    for case, (path, fragment) in upload_cases(tmp_path, tiny_adapters("a0")).items():
        given = _dir_of(case, path)
        with pytest.raises(SystemExit) as info:
            main(["adapters", "upload", "x", str(given), "--server", "127.0.0.1:1",
                  "--timeout", "1"])
        err = capsys.readouterr().err
        assert info.value.code == 2 and str(path) in err and fragment in err, (case, err)
        with Client("127.0.0.1:1") as c, pytest.raises(AdapterDirError) as raised:
            c.upload_adapter("x", given)  # the Python API raises the same, at once
        assert fragment in str(raised.value)
