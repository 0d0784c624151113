"""The client side of the CLI against a real server: `loraplex generate --server`,
`loraplex adapters ...` errors, and the `python -m loraplex.client health` probe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from loraplex import client as client_mod
from loraplex.cli import main

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
