"""The messages of AdapterAdmin/UploadAdapter (``Client.upload_adapter``): an adapter
directory, or a PEFT model in memory (saved as ``save_pretrained`` writes it), as a header
then adapter_model.safetensors in chunks."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .proto import loraplex_pb2 as pb

CHUNK_BYTES = 1 << 20  # under gRPC's default 4 MiB message limit
CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"


def adapter_files(source: str | Path | Any) -> tuple[bytes, bytes]:
    """(adapter_config.json, adapter_model.safetensors) of a PEFT dir or a PEFT model."""
    if isinstance(source, (str, Path)):
        d = Path(source)
        return (d / CONFIG_NAME).read_bytes(), (d / WEIGHTS_NAME).read_bytes()
    if not hasattr(source, "save_pretrained"):
        raise TypeError(f"upload_adapter takes a PEFT adapter directory or a PEFT model, "
                        f"not {type(source).__name__}")
    with tempfile.TemporaryDirectory(prefix="loraplex-upload-") as d:
        source.save_pretrained(d, safe_serialization=True)
        return adapter_files(d)


def upload_messages(name: str, source: str | Path | Any, replace: bool = False,
                    pin: bool = False, chunk_bytes: int = CHUNK_BYTES
                    ) -> Iterator[pb.UploadAdapterRequest]:
    config, weights = adapter_files(source)
    header = pb.UploadAdapterHeader(name=name, adapter_config=config.decode(), replace=replace,
                                    pin=pin, size_bytes=len(weights))
    yield pb.UploadAdapterRequest(header=header)
    view = memoryview(weights)
    for at in range(0, len(weights), chunk_bytes):
        yield pb.UploadAdapterRequest(chunk=bytes(view[at:at + chunk_bytes]))
