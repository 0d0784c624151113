"""The messages of AdapterAdmin/UploadAdapter (``Client.upload_adapter``): an adapter
directory, or a PEFT model in memory (saved as ``save_pretrained`` writes it), as a header
then adapter_model.safetensors in chunks.

Invariant: the files are read and checked when ``upload_messages`` is called, before any
call starts; a directory the client cannot send raises ``AdapterDirError`` naming the path
and what is wrong (inside gRPC's request iterator it would only read "Exception iterating
requests!")."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..proto import loraplex_pb2 as pb

CHUNK_BYTES = 1 << 20  # under gRPC's default 4 MiB message limit
CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"  # PEFT's pickle: never sent, never read


class AdapterDirError(ValueError):
    """A local adapter directory that cannot be uploaded (the message names its path)."""


def adapter_files(source: str | Path | Any) -> tuple[bytes, bytes]:
    """(adapter_config.json, adapter_model.safetensors) of a PEFT dir or a PEFT model."""
    if isinstance(source, (str, Path)):
        return read_adapter_dir(Path(source))
    if not hasattr(source, "save_pretrained"):
        raise TypeError(f"upload_adapter takes a PEFT adapter directory or a PEFT model, "
                        f"not {type(source).__name__}")
    with tempfile.TemporaryDirectory(prefix="loraplex-upload-") as d:
        source.save_pretrained(d, safe_serialization=True)
        return adapter_files(d)


def read_adapter_dir(d: Path) -> tuple[bytes, bytes]:
    """The two files of the PEFT directory ``d``, checked as far as the client can: ``d`` a
    readable directory, the config a JSON object, the weights safetensors and not empty."""
    if not d.exists():
        raise AdapterDirError(f"{d}: no such directory" + _dangling(d))
    if not d.is_dir():
        raise AdapterDirError(f"{d} is a file: give the PEFT adapter directory that holds "
                              f"{CONFIG_NAME} and {WEIGHTS_NAME}")
    config = _read(d / CONFIG_NAME)
    try:
        parsed = json.loads(config.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise AdapterDirError(f"{d / CONFIG_NAME} is not readable JSON ({e})") from None
    if not isinstance(parsed, dict):
        raise AdapterDirError(f"{d / CONFIG_NAME} holds a JSON {type(parsed).__name__}, not "
                              "the object PEFT writes")
    weights_path = d / WEIGHTS_NAME
    if not os.path.lexists(weights_path) and (d / PICKLE_NAME).exists():
        raise AdapterDirError(f"{d} holds {PICKLE_NAME} (a pickle) and no {WEIGHTS_NAME}: "
                              "pickles are never sent or loaded; save the adapter with "
                              "save_pretrained(..., safe_serialization=True)")
    weights = _read(weights_path)
    if not weights:
        raise AdapterDirError(f"{weights_path} is empty (0 bytes)")
    return config, weights


def _read(path: Path) -> bytes:
    if not os.path.lexists(path):
        raise AdapterDirError(f"{path.parent} has no {path.name}: not a PEFT adapter "
                              "directory")
    if not path.exists():
        raise AdapterDirError(f"{path} is not readable" + _dangling(path))
    if path.is_dir():
        raise AdapterDirError(f"{path} is a directory, not a file")
    try:
        return path.read_bytes()
    except OSError as e:
        raise AdapterDirError(f"{path} is not readable: {e.strerror or e}") from None


def _dangling(path: Path) -> str:
    return f" (a symlink to {os.readlink(path)}, which does not exist)" \
        if path.is_symlink() else ""


def upload_messages(name: str, source: str | Path | Any, replace: bool = False,
                    pin: bool = False, chunk_bytes: int = CHUNK_BYTES
                    ) -> Iterator[pb.UploadAdapterRequest]:
    """The stream's messages; the files are read (and checked) now, not as it is sent."""
    config, weights = adapter_files(source)
    header = pb.UploadAdapterHeader(name=name, adapter_config=config.decode(), replace=replace,
                                    pin=pin, size_bytes=len(weights))
    return _messages(header, weights, chunk_bytes)


def _messages(header: pb.UploadAdapterHeader, weights: bytes, chunk_bytes: int
              ) -> Iterator[pb.UploadAdapterRequest]:
    yield pb.UploadAdapterRequest(header=header)
    view = memoryview(weights)
    for at in range(0, len(weights), chunk_bytes):
        yield pb.UploadAdapterRequest(chunk=bytes(view[at:at + chunk_bytes]))
