"""UploadAdapter: an adapter's files over a gRPC stream, for trainers with no disk the server
reads. The header (name, adapter_config.json, replace) comes first, then the bytes of
adapter_model.safetensors in chunks; they are written as a PEFT directory of the upload
store (``--upload-dir``, else a private temporary one) and loaded as LoadAdapter loads a
directory (the same checks), through ``adapters`` (this server's, or the cluster's).

Invariant: nothing is half registered. The directory is complete before the load starts;
a bad header, bad bytes, a size past ``--max-upload-bytes``, a stream that ends short of its
declared size or is cut (cancelled) removes the directory, and the name keeps what it had.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from ..lora.cached_adapter import AdapterInfo
from ..lora.peft_format import WEIGHTS_NAME
from ..lora.upload_store import UploadStore, write_config
from ..proto import loraplex_pb2 as pb
from .adapter_ops import AdapterOps
from .adapter_paths import check_adapter_name
from .error_code import ErrorCode, ServiceError
from .state import ServerState


def upload_store(state: ServerState) -> UploadStore:
    """``--upload-dir`` when given (kept: other replicas may read it), else the engine's
    private store (an upload's directory goes with its adapter)."""
    root = state.options.upload_dir
    if root is not None:
        return UploadStore(root)
    return state.require_engine().engine.uploads


async def receive_upload(state: ServerState, adapters: AdapterOps,
                         requests: AsyncIterator[pb.UploadAdapterRequest]) -> AdapterInfo:
    """Write the stream to a fresh directory, then load it as ``header.name``."""
    header = await _header(requests)
    name = check_adapter_name(header.name, state.options.served_model_name)
    limit = state.options.max_upload_bytes
    if header.size_bytes > limit:  # refused before a byte of the weights is read
        raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED,
                           f"header.size_bytes={header.size_bytes} is over --max-upload-bytes "
                           f"({limit}); send at most that")
    engine = state.require_engine()
    await engine.run(lambda e: e.lora.check_name(name, header.replace))  # before the bytes
    store = upload_store(state)
    out = store.new_dir(name)
    try:
        write_config(out, header.adapter_config.encode())
        await _write_weights(requests, out / WEIGHTS_NAME, limit, header.size_bytes)
        return await adapters.load(name, str(out), replace=header.replace, pin=header.pin,
                                   source="upload")
    except BaseException:
        store.discard(out)
        raise


async def _header(requests: AsyncIterator[pb.UploadAdapterRequest]) -> pb.UploadAdapterHeader:
    first = await anext(aiter(requests), None)
    if first is None or first.WhichOneof("part") != "header":
        raise ValueError("the first UploadAdapter message must be the header (name, "
                         "adapter_config, replace); the weights' chunks follow it")
    if not first.header.adapter_config.strip():
        raise ValueError("header.adapter_config is empty: give the text of adapter_config.json")
    return first.header


async def _write_weights(requests: AsyncIterator[pb.UploadAdapterRequest], path: Path,
                         limit: int, declared: int) -> None:
    total = 0
    with path.open("wb") as f:
        async for msg in requests:
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
            f.write(msg.chunk)
    if declared and total != declared:
        raise ValueError(f"the upload ended after {total} of the {declared} bytes "
                         "header.size_bytes declared (a stream cut short); nothing was loaded")
    if total == 0:
        raise ValueError("the upload carried no weights: send adapter_model.safetensors in "
                         "chunks after the header")
