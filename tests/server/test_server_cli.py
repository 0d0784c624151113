"""The client side of the CLI against a real server: `loraplex generate --server`,
`loraplex adapters ...` errors, and the `python -m loraplex.client health` probe."""

from __future__ import annotations

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
    with server.client() as c:
        whole = c.generate("the cat", temperature=0.0, apply_chat_template=True)
    assert main(["generate", "--server", server.target, "the cat"]) == 0
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
