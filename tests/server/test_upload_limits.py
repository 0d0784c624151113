"""Bounded uploads (issue 42, item 8) over a real server and loraplex's gRPC client: at most
--max-concurrent-uploads streams (the next is RESOURCE_EXHAUSTED, the others complete), a
stream idle past --upload-idle-timeout, or still sending at --upload-timeout, is dropped
(DEADLINE_EXCEEDED) with its directory,
--upload-disk-budget refuses declared sizes at the header and undeclared bytes as they come,
a cut stream gives everything back, and the event loop answers while a chunk is written.

The streams are driven by ``Feed``: the client's thread sends the header and a first chunk,
then holds the stream open as the test says, so a test knows which uploads are in flight."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from loraplex.client import adapter_files
from loraplex.proto import loraplex_pb2 as pb

from tests.server.conftest import wait_until

LIMIT = 1 << 20  # --max-upload-bytes
BUDGET = LIMIT * 3 // 2  # --upload-disk-budget
IDLE = 2.0  # --upload-idle-timeout, seconds
CAP = 2  # --max-concurrent-uploads
SLOW_WRITE_S = 60.0  # the slow disk's one write stalls until released, this long at most
IDS = [10, 20, 30, 40]


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path) -> Any:
    return serve(lambda: make_engine(tiny_llama), max_upload_bytes=LIMIT,
                 max_concurrent_uploads=CAP, upload_idle_timeout_s=IDLE,
                 upload_disk_budget=BUDGET)


@pytest.fixture(scope="module")
def client(server: Any) -> Iterator[Any]:
    with server.client() as c:
        yield c


class Feed:
    """One upload's stream: the header (``declared`` bytes; default the weights' size) and,
    unless ``header`` is False, a first one-byte chunk at once; then, until ``go`` is set,
    nothing (``keepalive`` False: the server sees a stalled stream) or one more byte every
    0.2 s (the stream stays live); then the rest of the weights."""

    def __init__(self, name: str, files: tuple[bytes, bytes], declared: int | None = None,
                 keepalive: bool = True, header: bool = True):
        self.name, (self.config, self.weights) = name, files
        self.declared = len(self.weights) if declared is None else declared
        self.keepalive, self.header = keepalive, header
        self.go = threading.Event()

    def __iter__(self) -> Iterator[pb.UploadAdapterRequest]:
        if not self.header:
            self.go.wait(60)
            return
        yield pb.UploadAdapterRequest(header=pb.UploadAdapterHeader(
            name=self.name, adapter_config=self.config.decode(), size_bytes=self.declared))
        sent = 1
        yield pb.UploadAdapterRequest(chunk=self.weights[:1])
        while not self.go.wait(0.2 if self.keepalive else 60):
            if sent < len(self.weights) - 1:
                yield pb.UploadAdapterRequest(chunk=self.weights[sent:sent + 1])
                sent += 1
        yield pb.UploadAdapterRequest(chunk=self.weights[sent:])

    def start(self, client: Any) -> grpc.Future:
        return client._s.admin.UploadAdapter.future(iter(self), **client._s.adm(120))


def send(client: Any, name: str, config: bytes, weights: bytes, declared: int,
         chunk: int = 1 << 16) -> pb.AdapterInfo:
    header = pb.UploadAdapterHeader(name=name, adapter_config=config.decode(),
                                    size_bytes=declared)
    messages = [pb.UploadAdapterRequest(header=header)] + [
        pb.UploadAdapterRequest(chunk=weights[i:i + chunk]) for i in range(0, len(weights), chunk)]
    return client._s.admin.UploadAdapter(iter(messages), **client._s.adm(60))


def dirs(server: Any) -> list[Path]:
    """The upload store's directories (one per upload in flight or kept adapter)."""
    return sorted(server.engine.uploads.root.iterdir())


def refused(call: Any, code: grpc.StatusCode, fragment: str) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    details = info.value.details()
    assert info.value.code() == code and fragment in details, (info.value.code(), details)
    assert "loraplex-uploads-" not in details  # never the store's paths
    return details


def names(client: Any) -> set[str]:
    return {a.name for a in client.list_adapters()}


def test_uploads_past_the_cap_are_refused_and_the_others_complete(server, client,
                                                                  tiny_adapters) -> None:
    before = dirs(server)
    feeds = [Feed(f"cap{i}", adapter_files(tiny_adapters(f"c{i}"))) for i in range(CAP)]
    calls = [f.start(client) for f in feeds]
    wait_until(lambda: len(dirs(server)) == len(before) + CAP, 30, "both uploads in flight")
    details = refused(lambda: client.upload_adapter("cap-next", tiny_adapters("c9")),
                      grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-concurrent-uploads")
    assert f"({CAP})" in details
    for f in feeds:
        f.go.set()
    assert [c.result(60).name for c in calls] == ["cap0", "cap1"]
    assert {"cap0", "cap1"} <= names(client) and "cap-next" not in names(client)
    assert client.upload_adapter("cap-next", tiny_adapters("c9")).version == 1  # a slot freed
    want = client.generate(prompt_token_ids=IDS, adapter="cap0", temperature=0.0,
                           max_new_tokens=4, ignore_eos=True).token_ids
    client.load_adapter("cap0-disk", tiny_adapters("c0"))
    assert client.generate(prompt_token_ids=IDS, adapter="cap0-disk", temperature=0.0,
                           max_new_tokens=4, ignore_eos=True).token_ids == want
    for name in ("cap0", "cap1", "cap-next", "cap0-disk"):
        client.unload_adapter(name)
    wait_until(lambda: dirs(server) == before, 30, "the kept uploads' directories gone")


def test_a_stalled_upload_is_dropped_after_the_idle_timeout(server, client,
                                                            tiny_adapters) -> None:
    """One stream stalls after its header and a chunk, one before any message: both are
    refused once the idle timeout passes, with nothing left; then both slots serve again."""
    before = dirs(server)
    files = adapter_files(tiny_adapters("s0"))
    feeds = [Feed("stall-mid", files, keepalive=False), Feed("stall-open", files, header=False)]
    start = time.monotonic()
    calls = [f.start(client) for f in feeds]
    wait_until(lambda: len(dirs(server)) == len(before) + 1, 30, "the stalled upload's dir")
    for call in calls:
        details = refused(lambda c=call: c.result(60), grpc.StatusCode.DEADLINE_EXCEEDED,
                          "--upload-idle-timeout")
        assert f"{IDLE:g} s" in details
    assert time.monotonic() - start >= IDLE  # not before the timeout
    wait_until(lambda: dirs(server) == before, 30, "the stalled upload's dir removed")
    assert not {"stall-mid", "stall-open"} & names(client)
    for f in feeds:
        f.go.set()
    with ThreadPoolExecutor(CAP) as pool:  # both places are free again
        infos = list(pool.map(lambda n: client.upload_adapter(n, tiny_adapters("s0")),
                              ["after0", "after1"]))
    assert [i.version for i in infos] == [1, 1]
    for name in ("after0", "after1"):
        client.unload_adapter(name)
    wait_until(lambda: dirs(server) == before, 30, "the kept uploads' directories gone")


def test_a_trickling_upload_is_dropped_at_the_upload_timeout(serve, make_engine, tiny_llama,
                                                             tiny_adapters) -> None:
    """A byte every 0.2 s never trips the idle timeout; --upload-timeout ends it anyway."""
    other = serve(lambda: make_engine(tiny_llama), upload_idle_timeout_s=IDLE,
                  upload_timeout_s=2 * IDLE)
    with other.client() as c:
        feed = Feed("trickle", adapter_files(tiny_adapters("t0")))
        start = time.monotonic()
        call = feed.start(c)
        details = refused(lambda: call.result(60), grpc.StatusCode.DEADLINE_EXCEEDED,
                          "--upload-timeout")
        assert time.monotonic() - start >= 2 * IDLE and f"{2 * IDLE:g} s" in details
        feed.go.set()
        wait_until(lambda: dirs(other) == [], 30, "the trickling upload's dir removed")
        assert "trickle" not in names(c)


def test_the_disk_budget_and_a_cut_stream_giving_it_back(server, client,
                                                         tiny_adapters) -> None:
    before = dirs(server)
    config, weights = adapter_files(tiny_adapters("b0"))
    big = Feed("big", (config, weights), declared=LIMIT)  # reserves LIMIT at its header
    call = big.start(client)
    wait_until(lambda: len(dirs(server)) == len(before) + 1, 30, "the big upload in flight")
    # declared: refused at the header, before any directory or byte
    refused(lambda: send(client, "b-declared", config, b"\0" * (BUDGET - LIMIT + 1),
                         declared=BUDGET - LIMIT + 1),
            grpc.StatusCode.RESOURCE_EXHAUSTED, "--upload-disk-budget")
    # undeclared: refused when its bytes pass what is left; its directory goes
    refused(lambda: send(client, "b-undeclared", config, b"\0" * (BUDGET - LIMIT + 1),
                         declared=0),
            grpc.StatusCode.RESOURCE_EXHAUSTED, "--upload-disk-budget")
    assert len(dirs(server)) == len(before) + 1
    assert send(client, "b-fits", config, weights, declared=len(weights)).version == 1
    call.cancel()  # the client cuts the big stream
    big.go.set()
    wait_until(lambda: len(dirs(server)) == len(before) + 1, 30, "the cut stream's dir gone")
    assert "big" not in names(client)
    # the whole budget but b-fits' is free again: LIMIT declared is admitted (and then
    # refused for what its bytes are, not for their size)
    refused(lambda: send(client, "b-limit", config, b"\0" * LIMIT, declared=LIMIT),
            grpc.StatusCode.INVALID_ARGUMENT, "safetensors")
    client.unload_adapter("b-fits")
    wait_until(lambda: dirs(server) == before, 30, "every upload directory gone")


def test_a_disk_that_fails_is_an_error_without_its_paths(serve, make_engine, tiny_llama,
                                                         tiny_adapters, tmp_path) -> None:
    """The --upload-dir turns into a file after the start: INTERNAL (the server's fault),
    logged in full, told to the client without the path; the server keeps serving."""
    up = tmp_path / "uploads"
    other = serve(lambda: make_engine(tiny_llama), upload_dir=up)
    up.write_text("not a directory any more")
    with other.client() as c:
        details = refused(lambda: c.upload_adapter("disk", tiny_adapters("d0")),
                          grpc.StatusCode.INTERNAL, "could not write the upload")
        assert str(tmp_path) not in details
        assert len(c.generate(prompt_token_ids=IDS, temperature=0.0, max_new_tokens=2,
                              ignore_eos=True).token_ids) == 2
        assert "disk" not in names(c)


class SlowDisk:
    """A file whose first write stalls until ``release`` is set, SLOW_WRITE_S at most (a
    slow or stalled disk)."""

    def __init__(self, f: Any):
        self.f, self.writing, self.wrote = f, threading.Event(), threading.Event()
        self.release = threading.Event()

    def write(self, data: bytes) -> int:
        if not self.writing.is_set():
            self.writing.set()
            self.release.wait(SLOW_WRITE_S)
            self.wrote.set()
        return self.f.write(data)

    def close(self) -> None:
        self.f.close()


def test_the_event_loop_answers_while_a_chunk_is_written(server, client, tiny_adapters,
                                                         monkeypatch) -> None:
    """The store's disk stalls a write: health, a generate and ListAdapters answer while
    that write still runs (written on the event loop, each would wait for it, and the write
    would end by its SLOW_WRITE_S bound first); then the write goes on and the upload ends."""
    store = server.engine.uploads
    opened: list[SlowDisk] = []
    open_weights = store.open_weights

    def slow_open(upload: Path) -> SlowDisk:
        opened.append(SlowDisk(open_weights(upload)))
        return opened[-1]

    monkeypatch.setattr(store, "open_weights", slow_open)
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(client.upload_adapter, "slow", tiny_adapters("w0"))
        wait_until(lambda: bool(opened) and opened[0].writing.is_set(), 30, "the slow write")
        assert client.health() == "SERVING"
        out = client.generate(prompt_token_ids=IDS, temperature=0.0, max_new_tokens=4,
                              ignore_eos=True, timeout=SLOW_WRITE_S / 2)
        assert len(out.token_ids) == 4
        assert "slow" not in names(client)
        assert not opened[0].wrote.is_set()  # all of that while the write still ran
        opened[0].release.set()
        assert done.result(60).version == 1
    client.unload_adapter("slow")
