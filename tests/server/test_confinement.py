"""Confinement of every file an adapter makes the server open (issue 42), against a real
server: files that link out of --adapter-root or --lora-resolver-dir are refused on every
way in, links inside a root load, a file swapped for a link out after registration is
refused when the adapter is read again after its eviction, an upload never opens the base
model path it names, adapter names are canonical on every way in, and no error shows a
server-internal path."""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from loraplex.client import adapter_files
from loraplex.proto import loraplex_pb2 as pb

from tests.adapter_dirs import edit_config, edit_tensors
from tests.server.conftest import wait_until

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
IDS = [10, 20, 30, 40]
GREEDY = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
BAD_NAMES = ["a/../b", "a/./b", "a//b", "a/", "a/..", "/a", "a\\b", "..", "."]


def link_files(into: Path, source: Path, names: tuple[str, ...] = (CONFIG, WEIGHTS)) -> Path:
    """A directory ``into`` whose ``names`` are symlinks to ``source``'s files (the rest
    copied)."""
    into.mkdir()
    for f in source.iterdir():
        if f.name in names:
            (into / f.name).symlink_to(f)
        else:
            shutil.copy(f, into / f.name)
    return into


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory, tiny_adapters, tiny_llama: Path
           ) -> dict[str, Path]:
    top = tmp_path_factory.mktemp("confinement")
    root, resolver, outside = top / "root", top / "resolver", top / "outside"
    for d in (root, resolver, outside):
        d.mkdir()
    good = tiny_adapters("c0")
    shutil.copytree(good, outside / "good")
    shutil.copytree(good, root / "store")  # what the in-root links point at
    link_files(root / "links-out", outside / "good")
    link_files(root / "weights-out", outside / "good", (WEIGHTS,))
    link_files(root / "config-out", outside / "good", (CONFIG,))
    link_files(root / "links-in", root / "store")
    shutil.copytree(good, resolver / "good")
    link_files(resolver / "r-out", outside / "good")
    link_files(resolver / "r-in", resolver / "good")
    for name in ("swap", "other"):
        shutil.copytree(tiny_adapters(name), root / name)
    # the swap's outside twin: the same shapes, other values (served, it would change tokens)
    shutil.copytree(root / "swap", outside / "swap")
    edit_tensors(outside / "swap", lambda t: [v.mul_(3.0) for v in t.values()])
    wide = outside / "wide-base"  # a base config of another size, outside every root
    wide.mkdir()
    cfg = json.loads((tiny_llama / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**cfg, "hidden_size": 128}))
    shutil.copytree(good, root / "names-wide")
    edit_config(root / "names-wide", base_model_name_or_path=str(wide))
    return {"root": root, "resolver": resolver, "outside": outside, "wide": wide, "top": top}


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path, layout: dict[str, Path]) -> Any:
    # one adapter on the device and one in host memory: using another evicts from both
    return serve(lambda: make_engine(tiny_llama, max_loras=1, max_cpu_loras=1),
                 adapter_roots=[layout["root"]], lora_resolver_dir=layout["resolver"],
                 http_port=0)


@pytest.fixture(scope="module")
def client(server: Any):
    with server.client() as c:
        yield c


def http_load(server: Any, name: str, path: Path | str) -> httpx.Response:
    return httpx.post(f"{server.http_url}/v1/load_lora_adapter", timeout=60,
                      json={"lora_name": name, "lora_path": str(path)})


def complete(server: Any, model: str) -> httpx.Response:
    return httpx.post(f"{server.http_url}/v1/completions", timeout=60,
                      json={"model": model, "prompt": IDS, "max_tokens": 2})


def internal_paths(server: Any, layout: dict[str, Path], tiny_llama: Path) -> list[str]:
    """What no message may show: the roots, the resolver dir, the model dir, the upload
    store, the temp dir, and where links lead."""
    found = [str(layout["root"]), str(layout["resolver"]), str(layout["outside"]),
             str(tiny_llama), tempfile.gettempdir(), "/proc/self/fd"]
    return found + ([str(server.engine.uploads.root)] if server.engine.uploads._root else [])


def assert_no_internal_path(message: str, server: Any, layout: dict[str, Path],
                            tiny_llama: Path, sent: str = "") -> None:
    shown = message.replace(sent, "<sent>") if sent else message
    for path in internal_paths(server, layout, tiny_llama):
        assert path not in shown, (path, message)


def names(client: Any) -> set[str]:
    return {a.name for a in client.list_adapters()}


# ---- files linked out of a root ----------------------------------------------------------
@pytest.mark.parametrize("folder", ["links-out", "weights-out", "config-out"])
def test_files_linked_out_of_the_adapter_root_are_refused(server: Any, client: Any,
                                                          layout: dict[str, Path], folder: str,
                                                          tiny_llama: Path) -> None:
    path = layout["root"] / folder
    r = http_load(server, "out", path)
    assert r.status_code == 403, r.text
    message = r.json()["error"]["message"]
    assert "outside" in message
    assert_no_internal_path(message, server, layout, tiny_llama, sent=str(path))
    with pytest.raises(grpc.RpcError) as info:
        client.load_adapter("out", path)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "out" not in names(client)


def test_links_that_stay_inside_the_root_load(server: Any, client: Any,
                                              layout: dict[str, Path]) -> None:
    assert http_load(server, "in", layout["root"] / "links-in").status_code == 200
    client.load_adapter("plain", layout["root"] / "store")
    assert client.generate(prompt_token_ids=IDS, adapter="in", **GREEDY).token_ids == \
        client.generate(prompt_token_ids=IDS, adapter="plain", **GREEDY).token_ids
    for name in ("in", "plain"):
        client.unload_adapter(name)


def test_the_resolver_refuses_files_linked_out_of_its_directory(
        server: Any, client: Any, layout: dict[str, Path], tiny_llama: Path) -> None:
    with pytest.raises(grpc.RpcError) as info:
        client.generate(prompt_token_ids=IDS, adapter="r-out", **GREEDY)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "<resolver r-out>" in info.value.details()
    assert_no_internal_path(info.value.details(), server, layout, tiny_llama)
    r = complete(server, "r-out")
    assert r.status_code == 403 and "outside" in r.json()["error"]["message"]
    assert "r-out" not in names(client)
    assert complete(server, "r-in").status_code == 200  # links inside the resolver dir


# ---- a file swapped after registration ---------------------------------------------------
def evicted(server: Any, name: str) -> bool:
    lora = server.engine.lora
    a = lora.names[name]
    return lora.host.weights(a) is None and not lora.host.reading(a) and \
        lora.device.slot(a) is None


def test_a_file_swapped_for_a_link_out_after_registration_is_refused(
        server: Any, client: Any, layout: dict[str, Path], tiny_llama: Path) -> None:
    """Registered from a good directory, used, evicted from the device and host memory by
    another adapter; then its weights become a link to a file outside the root. The read
    after the eviction refuses it (never serving the outside weights), for every request;
    other adapters are unaffected."""
    root = layout["root"]
    client.load_adapter("swap", root / "swap")
    client.load_adapter("other", root / "other")
    before = client.generate(prompt_token_ids=IDS, adapter="swap", **GREEDY).token_ids
    other = client.generate(prompt_token_ids=IDS, adapter="other", **GREEDY).token_ids
    wait_until(lambda: evicted(server, "swap"), what="swap evicted from device and host")
    kept = layout["top"] / "swap-weights"
    shutil.move(root / "swap" / WEIGHTS, kept)
    (root / "swap" / WEIGHTS).symlink_to(layout["outside"] / "swap" / WEIGHTS)
    for _ in range(2):  # the request that found it out, and every one after
        with pytest.raises(grpc.RpcError) as info:
            client.generate(prompt_token_ids=IDS, adapter="swap", **GREEDY)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
        assert "outside" in info.value.details() and "swap" in info.value.details()
    assert_no_internal_path(info.value.details(), server, layout, tiny_llama,
                            sent=str(root / "swap"))
    assert client.generate(prompt_token_ids=IDS, adapter="other", **GREEDY).token_ids == other
    # put back and loaded again (in place): the inside file serves as before
    (root / "swap" / WEIGHTS).unlink()
    shutil.move(kept, root / "swap" / WEIGHTS)
    client.load_adapter("swap", root / "swap", replace=True)
    again = client.generate(prompt_token_ids=IDS, adapter="swap", **GREEDY).token_ids
    assert again == before
    for name in ("swap", "other"):
        client.unload_adapter(name)


# ---- base_model_name_or_path -------------------------------------------------------------
def upload(client: Any, name: str, config: bytes, weights: bytes) -> pb.AdapterInfo:
    """An UploadAdapter stream of raw messages (the client checks nothing)."""
    header = pb.UploadAdapterHeader(name=name, adapter_config=config.decode(),
                                    size_bytes=len(weights))
    cuts = [0, len(weights) // 2, len(weights)]
    messages = [pb.UploadAdapterRequest(header=header)] + [
        pb.UploadAdapterRequest(chunk=weights[a:b]) for a, b in itertools.pairwise(cuts)]
    return client._s.admin.UploadAdapter(iter(messages), **client._s.adm(60))


def test_an_adapter_never_makes_the_server_open_its_base_path(
        server: Any, client: Any, layout: dict[str, Path], tiny_adapters) -> None:
    """base_model_name_or_path naming a readable config.json of another hidden_size outside
    the adapter's root: were it opened, the adapter would be refused as trained on another
    base (the message echoing its fields). An upload and a path load both load it."""
    config, weights = adapter_files(tiny_adapters("c0"))
    named = json.loads(config)
    named["base_model_name_or_path"] = str(layout["wide"])
    info = upload(client, "up-wide", json.dumps(named).encode(), weights)
    assert info.name == "up-wide"
    assert client.load_adapter("path-wide", layout["root"] / "names-wide").name == "path-wide"
    for name in ("up-wide", "path-wide"):
        assert client.generate(prompt_token_ids=IDS, adapter=name, **GREEDY).token_ids
        client.unload_adapter(name)


def test_upload_errors_name_the_upload_not_its_directory(
        server: Any, client: Any, layout: dict[str, Path], tiny_llama: Path,
        tiny_adapters) -> None:
    config, weights = adapter_files(tiny_adapters("c0"))
    for bad_config, bad_weights, fragment in [
            (b"{not json", weights, "not readable JSON"),
            (config, b"garbage" * 10, "safetensors"),
            (config.replace(b'"LORA"', b'"IA3"'), weights, "not a LoRA adapter")]:
        with pytest.raises(grpc.RpcError) as info:
            upload(client, "bad-up", bad_config, bad_weights)
        details = info.value.details()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details
        assert fragment in details and "<upload bad-up>" in details, details
        assert_no_internal_path(details, server, layout, tiny_llama)


def test_resolver_errors_name_the_adapter_not_the_directory(
        server: Any, client: Any, layout: dict[str, Path], tiny_llama: Path) -> None:
    broken = layout["resolver"] / "broken"
    broken.mkdir(exist_ok=True)
    (broken / CONFIG).write_text("{not json")
    for model in ("broken", "absent"):
        with pytest.raises(grpc.RpcError) as info:
            client.generate(prompt_token_ids=IDS, adapter=model, **GREEDY)
        assert_no_internal_path(info.value.details(), server, layout, tiny_llama)
    assert "<resolver broken>" in complete(server, "broken").json()["error"]["message"]


# ---- canonical names ---------------------------------------------------------------------
@pytest.mark.parametrize("bad", BAD_NAMES)
def test_names_that_are_not_canonical_are_refused_on_every_way_in(
        server: Any, client: Any, layout: dict[str, Path], tiny_adapters, bad: str) -> None:
    before = names(client)
    good = layout["root"] / "store"
    with pytest.raises(grpc.RpcError) as info:
        client.load_adapter(bad, good)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    r = http_load(server, bad, good)
    assert r.status_code == 400, r.text
    config, weights = adapter_files(tiny_adapters("c0"))
    with pytest.raises(grpc.RpcError) as info:
        upload(client, bad, config, weights)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert names(client) == before


@pytest.mark.parametrize("model", ["x/../good", "./good", "good/.", "good//", "x\\..\\good"])
def test_a_request_model_that_is_not_canonical_is_refused(server: Any, client: Any,
                                                          model: str) -> None:
    """``x/../good`` would make the resolver load ``good`` again under a new name."""
    reads = server.server.state.resolver.reads
    with pytest.raises(grpc.RpcError) as info:
        client.generate(prompt_token_ids=IDS, adapter=model, **GREEDY)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    r = complete(server, model)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and ("segment" in message or "backslash" in message), message
    assert model not in names(client) and server.server.state.resolver.reads == reads


def test_lora_modules_names_are_canonical(capsys, layout: dict[str, Path]) -> None:
    from loraplex.cli import main

    for bad in ("a/../b", "a//b", "a\\b"):
        with pytest.raises(SystemExit) as info:
            main(["serve", "--lora-modules", f"{bad}={layout['root'] / 'store'}"])
        assert info.value.code == 2
        assert "adapter name" in capsys.readouterr().err


def test_a_resolver_load_holds_a_place_of_max_queue(server: Any, layout: dict[str, Path]
                                                    ) -> None:
    """A first use loads before its request is checked (its tokenizer may be the adapter's):
    the load holds one of ``--max-queue``'s places, so with none free it is refused
    (429 / RESOURCE_EXHAUSTED) and nothing is read."""
    shutil.copytree(layout["resolver"] / "good", layout["resolver"] / "queued")
    state = server.server.state
    reads, full = state.resolver.reads, state.options.max_queue
    state.in_flight += full  # every place taken (nothing else runs in this module's server)
    try:
        r = complete(server, "queued")
    finally:
        state.in_flight -= full
    assert r.status_code == 429 and "--max-queue" in r.json()["error"]["message"], r.text
    assert state.resolver.reads == reads
    assert complete(server, "queued").status_code == 200 and state.resolver.reads == reads + 1
