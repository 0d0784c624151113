"""The two files of a PEFT adapter dir, each parsed once: ``adapter_config.json`` (through
PEFT's ``LoraConfig``, ``peft_checks.parse_lora_config``) and the safetensors header (through
``safetensors.safe_open``; no tensor data is read). Both are opened through
``AdapterFiles.open`` (confined to the adapter's root, lora/adapter_files.py), and what is
parsed is what was read from that open file.

``PARSED`` caches both, so that inspecting an adapter at registration and reading its
weights later parse each file once. The key of a file is (real path of the file opened,
size, digest of the bytes parsed): the whole config, the header's bytes. A digest, not the
mtime: mtimes tick in jiffies, so a file rewritten in place within a few ms at the same size
would look unchanged; reading ~1 KB of config and the header (~40 KB for 420 tensors) costs
tens of µs, parsing them about a millisecond. The cache is thread-safe (loader threads
inspect and read several adapters at once) and small: an LRU of ``PARSED.maxsize`` files.
Failures are not cached. Cached values are shared: treat them as read-only.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

from peft import LoraConfig
from safetensors import safe_open

from .adapter_files import AdapterFiles, MissingFile, fd_path, read_all, real_path
from .peft_checks import AdapterError, parse_lora_config

T = TypeVar("T")
ContentKey = tuple[str, int, bytes]  # (real path, file size, digest of the bytes parsed)

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# safetensors dtype -> bytes per element (every dtype its format names, floating or not)
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
            "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
            "I64": 8, "U64": 8, "F64": 8, "C64": 8}


def content_key(real: str | Path, size: int, parsed: bytes) -> ContentKey:
    """The key of ``parsed``, read from the file whose real path is ``real``."""
    return str(real), size, hashlib.blake2b(parsed, digest_size=16).digest()


def config_key(path: Path) -> ContentKey:
    """The key of this version of a config file (opened by name, unconfined); AdapterError if
    it cannot be read."""
    with AdapterFiles(path.parent).open(path.name) as f:
        raw = read_all(f, str(path.name))
        return content_key(real_path(f, path), len(raw), raw)


def header_key(path: Path) -> ContentKey:
    """The key of this version of a safetensors file's header (opened by name, unconfined);
    AdapterError if it cannot be read."""
    with AdapterFiles(path.parent).open(path.name) as f:
        return header_key_of(f, real_path(f, path))


def header_key_of(f: BinaryIO, real: str) -> ContentKey:
    """The key of the header of the open safetensors file ``f`` (whose real path is
    ``real``), read from ``f``."""
    f.seek(0)
    head = f.read(8)
    n = int.from_bytes(head, "little")
    size = os.fstat(f.fileno()).st_size
    if len(head) == 8 and n <= size:  # else corrupt: the digest of 8 bytes will do
        head += f.read(n)
    return content_key(real, size, head)


@dataclass(frozen=True)
class SafetensorsHeader:
    """A safetensors file's header: its tensors in file (offset) order. safe_open has checked
    that their data lies back to back from ``data_start`` to the end of the file."""

    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype "BF16", shape), file order
    data_start: int  # 8 + the header's length: where the first tensor's bytes begin
    file_bytes: int
    key: ContentKey  # of the header parsed


def read_header(f: BinaryIO, key: ContentKey, where: str) -> SafetensorsHeader:
    """Parse the header of the open safetensors file ``f`` (keyed ``key``); AdapterError
    if it is unreadable. safe_open reads the same open file (``fd_path``)."""
    try:
        with safe_open(fd_path(f), framework="pt", device="cpu") as st:
            tensors = {}
            for name in st.offset_keys():
                s = st.get_slice(name)
                tensors[name] = (s.get_dtype(), tuple(s.get_shape()))
        f.seek(0)
        data_start = 8 + int.from_bytes(f.read(8), "little")
    except Exception as exc:  # SafetensorError and friends: truncated, bad header, bad offsets
        raise AdapterError(f"{where} is not a readable safetensors file (truncated or "
                           f"corrupt?): {_without_paths(exc)}") from exc
    return SafetensorsHeader(tensors, data_start, key[1], key)


def _without_paths(exc: Exception) -> str:
    """``exc``'s text, less the descriptor path safe_open was given (an OSError's
    filename)."""
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


class ParseCache:
    """An LRU of parsed files keyed by (what was parsed, ContentKey); thread-safe."""

    def __init__(self, maxsize: int = 128):
        self.maxsize = maxsize
        self.hits = self.misses = 0
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, ContentKey], object] = OrderedDict()

    def get(self, kind: str, key: ContentKey, parse: Callable[[], T],
            unchanged: Callable[[], bool] | None = None) -> T:
        """``parse()``, or the value parsed from the bytes keyed ``key`` before. With
        ``unchanged`` (does the file still hold the bytes keyed?), a file that changed while
        it was parsed is parsed, but not cached."""
        entry = (kind, key)
        with self._lock:
            if entry in self._entries:
                self.hits += 1
                self._entries.move_to_end(entry)
                return self._entries[entry]  # type: ignore[return-value]
            self.misses += 1
        value = parse()  # outside the lock: other files parse meanwhile
        if unchanged is None or unchanged():
            with self._lock:
                self._entries[entry] = value
                self._entries.move_to_end(entry)
                while len(self._entries) > self.maxsize:
                    self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0


PARSED = ParseCache()


def lora_config(files: AdapterFiles) -> tuple[LoraConfig, ContentKey]:
    """The adapter's ``adapter_config.json`` (read confined, parsed once per content) and the
    key of the bytes parsed; AdapterError if it is missing or unreadable."""
    where = files.label(CONFIG_NAME)
    try:
        with files.open(CONFIG_NAME) as f:
            raw = read_all(f, where)
            key = content_key(real_path(f, files.dir / CONFIG_NAME), len(raw), raw)
    except MissingFile:
        raise AdapterError(f"{where} is missing; a PEFT LoRA adapter directory holds "
                           f"{CONFIG_NAME} and {WEIGHTS_NAME}") from None
    return PARSED.get("lora_config", key, lambda: parse_lora_config(raw, where)), key


def safetensors_header(files: AdapterFiles) -> SafetensorsHeader:
    """The header of the adapter's ``adapter_model.safetensors`` (read confined, parsed once
    per content); MissingFile if there is none, AdapterError if it is unreadable."""
    where = files.label(WEIGHTS_NAME)
    with files.open(WEIGHTS_NAME) as f:
        real = real_path(f, files.dir / WEIGHTS_NAME)
        if os.fstat(f.fileno()).st_size == 0:
            raise AdapterError(f"{where} is empty (0 bytes); it must be a safetensors file")
        key = header_key_of(f, real)
        return PARSED.get("safetensors_header", key, lambda: read_header(f, key, where),
                          lambda: header_key_of(f, real) == key)
