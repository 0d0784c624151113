"""UploadAdapter: an adapter's files over a gRPC stream, for trainers with no disk the server
reads. The header (name, adapter_config.json, replace) comes first, then the bytes of
adapter_model.safetensors in chunks; they are written as a PEFT directory of the upload
store (``--upload-dir``, else a private temporary one) and loaded as LoadAdapter loads a
directory (the same checks), through ``adapters`` (this server's, or the cluster's).

Invariants:
- Nothing is half registered. The directory is complete before the load starts; a bad
  header, bad bytes, a size past ``--max-upload-bytes``, a stream that ends short of its
  declared size, goes idle past ``--upload-idle-timeout``, is still sending after
  ``--upload-timeout`` or is cut (cancelled) removes the directory, and the name keeps what
  it had.
- Bounded: each stream holds a lease of ``UploadLimits`` (upload_limits.py) from its
  first message to its end, so at most ``--max-concurrent-uploads`` streams run and their
  weights hold at most ``--upload-disk-budget`` bytes, reserved before they are written
  (the declared ``size_bytes`` at once, else chunk by chunk). The lease is released however
  the stream ends.
- The event loop never touches the disk: directories, writes, closes and removals run on
  worker threads (at most one per upload at a time).
- Messages name the client's input, never the store's paths.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from ...lora.cached_adapter import AdapterInfo
from ...lora.peft_files import CONFIG_NAME
from ...lora.peft_format import WEIGHTS_NAME
from ...lora.upload_store import UploadStore, write_config
from ...proto import loraplex_pb2 as pb
from ..adapter_ops import AdapterOps
from ..adapter_paths import check_adapter_name
from ..error_code import ErrorCode, ServiceError, code_of
from ..state import ServerState
from .upload_limits import UploadLease, UploadLimits

log = logging.getLogger(__name__)


def upload_store(state: ServerState) -> UploadStore:
    """``--upload-dir`` when given (kept: other replicas may read it), else the engine's
    private store (an upload's directory goes with its adapter)."""
    root = state.options.upload_dir
    if root is not None:
        return UploadStore(root)
    return state.require_engine().engine.uploads


async def receive_upload(state: ServerState, adapters: AdapterOps, limits: UploadLimits,
                         requests: AsyncIterator[pb.UploadAdapterRequest]) -> AdapterInfo:
    """Write the stream to a fresh directory, then load it as ``header.name``."""
    with limits.admit() as lease:
        stream = Messages(requests, state.options.upload_idle_timeout_s,
                          state.options.upload_timeout_s)
        header = await _header(stream)
        name = check_adapter_name(header.name, state.served_model_name)
        limit = state.options.max_upload_bytes
        if header.size_bytes > limit:  # refused before a byte of the weights is read
            raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED,
                               f"header.size_bytes={header.size_bytes} is over "
                               f"--max-upload-bytes ({limit}); send at most that")
        lease.reserve(header.size_bytes)  # declared: the whole size, before any write
        engine = state.require_engine()
        await engine.run(lambda e: e.lora.check_name(name, header.replace))  # before the bytes
        store = upload_store(state)
        with _disk_errors():
            out = await asyncio.to_thread(store.new_dir, name)
        try:
            with _disk_errors():
                await asyncio.to_thread(write_config, out, header.adapter_config.encode())
                await _write_weights(stream, store, out, lease, limit, header.size_bytes)
            return await _load(adapters, name, out, header)
        except BaseException:
            # shielded: a cut stream (cancelled) still gets its directory removed
            await asyncio.shield(asyncio.to_thread(store.discard, out))
            raise


class Messages:
    """The stream's messages, each within ``idle_s`` of the one before and all within
    ``total_s`` of the first (else DEADLINE_EXCEEDED: a stream trickling a byte at a time
    holds its place no longer than that); None once the client has sent its last."""

    def __init__(self, requests: AsyncIterator[pb.UploadAdapterRequest], idle_s: float,
                 total_s: float):
        self._requests = aiter(requests)
        self.idle_s, self.total_s = idle_s, total_s
        self._deadline = time.monotonic() + total_s

    async def next(self) -> pb.UploadAdapterRequest | None:
        wait = min(self.idle_s, self._deadline - time.monotonic())
        try:
            return await asyncio.wait_for(anext(self._requests, None), max(wait, 0.0))
        except asyncio.TimeoutError:
            if wait < self.idle_s:
                raise ServiceError(
                    ErrorCode.DEADLINE_EXCEEDED,
                    f"the upload took longer than {self.total_s:g} s (--upload-timeout): "
                    "dropped, nothing was loaded; send it faster, or in less") from None
            raise ServiceError(
                ErrorCode.DEADLINE_EXCEEDED,
                f"the upload sent no message for {self.idle_s:g} s (--upload-idle-timeout): "
                "dropped, nothing was loaded; send the header and the chunks without such "
                "pauses") from None


async def _header(stream: Messages) -> pb.UploadAdapterHeader:
    first = await stream.next()
    if first is None or first.WhichOneof("part") != "header":
        raise ValueError("the first UploadAdapter message must be the header (name, "
                         "adapter_config, replace); the weights' chunks follow it")
    if not first.header.adapter_config.strip():
        raise ValueError("header.adapter_config is empty: give the text of adapter_config.json")
    return first.header


async def _write_weights(stream: Messages, store: UploadStore, out: Path, lease: UploadLease,
                         limit: int, declared: int) -> None:
    total = 0
    f: BinaryIO = await asyncio.to_thread(store.open_weights, out)
    try:
        while (msg := await stream.next()) is not None:
            if msg.WhichOneof("part") != "chunk":
                raise ValueError("UploadAdapter takes one header, first; every later message "
                                 "must be a chunk of adapter_model.safetensors")
            total += len(msg.chunk)
            if total > limit or (declared and total > declared):
                raise ServiceError(
                    ErrorCode.RESOURCE_EXHAUSTED if total > limit else
                    ErrorCode.INVALID_ARGUMENT,
                    f"the upload's weights pass {min(limit, declared or limit)} bytes "
                    f"({'--max-upload-bytes' if total > limit else 'header.size_bytes'}); "
                    "send at most that")
            if not declared:
                lease.reserve(len(msg.chunk))  # undeclared: each chunk before its write
            await asyncio.to_thread(f.write, msg.chunk)
    finally:
        await asyncio.to_thread(f.close)
    if declared and total != declared:
        raise ValueError(f"the upload ended after {total} of the {declared} bytes "
                         "header.size_bytes declared (a stream cut short); nothing was loaded")
    if total == 0:
        raise ValueError("the upload carried no weights: send adapter_model.safetensors in "
                         "chunks after the header")


@contextmanager
def _disk_errors() -> Iterator[None]:
    """The store's disk failing: logged in full, the client told why without the paths (a
    full disk is RESOURCE_EXHAUSTED, anything else the server's fault)."""
    try:
        yield
    except OSError as e:
        log.error("writing an upload failed: %s", e)
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED if full else ErrorCode.INTERNAL,
                           f"the server could not write the upload "
                           f"({e.strerror or type(e).__name__}); nothing was loaded") from None


async def _load(adapters: AdapterOps, name: str, out: Path,
                header: pb.UploadAdapterHeader) -> AdapterInfo:
    """LoadAdapter's load of the written directory; its errors keep their code, with the
    store's paths replaced by what the client sent."""
    try:
        return await adapters.load(name, str(out), replace=header.replace, pin=header.pin,
                                   source="upload")
    except ServiceError as e:
        raise ServiceError(e.code, _unpathed(e.message, out, name)) from None
    except (ValueError, LookupError) as e:  # the adapter's faults (an INTERNAL goes as is)
        code, message = code_of(e)
        raise ServiceError(code, _unpathed(message, out, name)) from None


def _unpathed(message: str, out: Path, name: str) -> str:
    for path, said in ((out / WEIGHTS_NAME, f"the uploaded {WEIGHTS_NAME}"),
                       (out / CONFIG_NAME, f"header.adapter_config ({CONFIG_NAME})"),
                       (out, f"upload {name!r}")):
        message = message.replace(str(path), said)
    return message
