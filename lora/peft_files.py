"""The two files of a PEFT adapter dir, each parsed once: ``adapter_config.json`` (through
PEFT's ``LoraConfig``, ``peft_checks.read_lora_config``) and the safetensors header (through
``safetensors.safe_open``; no tensor data is read).

``PARSED`` caches both, so that inspecting an adapter at registration and reading its
weights later parse each file once. The key of a file is (resolved path, size, digest of
the bytes parsed): the whole config, the header's bytes. A digest, not the mtime: mtimes
tick in jiffies, so a file rewritten in place within a few ms at the same size would look
unchanged; reading ~1 KB of config and the header (~40 KB for 420 tensors) costs tens of
µs, parsing them about a millisecond. The cache is thread-safe (loader threads inspect and
read several adapters at once) and small: an LRU of ``PARSED.maxsize`` files. Failures are
not cached. Cached values are shared: treat them as read-only.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from peft import LoraConfig
from safetensors import safe_open

from .peft_checks import AdapterError, read_lora_config

T = TypeVar("T")
ContentKey = tuple[str, int, bytes]  # (resolved path, file size, digest of the bytes parsed)

CONFIG_NAME = "adapter_config.json"
# safetensors dtype -> bytes per element (every dtype its format names, floating or not)
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
            "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
            "I64": 8, "U64": 8, "F64": 8, "C64": 8}


def content_key(path: Path, size: int, parsed: bytes) -> ContentKey:
    return str(path.resolve()), size, hashlib.blake2b(parsed, digest_size=16).digest()


def config_key(path: Path) -> ContentKey:
    """The key of this version of a config file; OSError if it cannot be read."""
    raw = path.read_bytes()
    return content_key(path, len(raw), raw)


def header_key(path: Path) -> ContentKey:
    """The key of this version of a safetensors file's header; OSError if it cannot be read."""
    with path.open("rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little")
        size = f.seek(0, 2)
        if len(head) == 8 and n <= size:  # else corrupt: the digest of 8 bytes will do
            f.seek(8)
            head += f.read(n)
    return content_key(path, size, head)


@dataclass(frozen=True)
class SafetensorsHeader:
    """A safetensors file's header: its tensors in file (offset) order. safe_open has checked
    that their data lies back to back from ``data_start`` to the end of the file."""

    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype "BF16", shape), file order
    data_start: int  # 8 + the header's length: where the first tensor's bytes begin
    file_bytes: int
    key: ContentKey  # of the header parsed


def read_header(path: Path) -> SafetensorsHeader:
    """Parse the header of the safetensors file ``path``; AdapterError if it is unreadable."""
    try:
        key = header_key(path)
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tensors = {}
            for name in f.offset_keys():
                s = f.get_slice(name)
                tensors[name] = (s.get_dtype(), tuple(s.get_shape()))
        with path.open("rb") as fh:
            data_start = 8 + int.from_bytes(fh.read(8), "little")
    except Exception as exc:  # SafetensorError and friends: truncated, bad header, bad offsets
        raise AdapterError(f"{path} is not a readable safetensors file (truncated or "
                           f"corrupt?): {exc}") from exc
    return SafetensorsHeader(tensors, data_start, key[1], key)


class ParseCache:
    """An LRU of parsed files keyed by (what was parsed, ContentKey); thread-safe."""

    def __init__(self, maxsize: int = 128):
        self.maxsize = maxsize
        self.hits = self.misses = 0
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, ContentKey], object] = OrderedDict()

    def get(self, kind: str, path: Path, key_of: Callable[[Path], ContentKey],
            parse: Callable[[Path], T]) -> T:
        """``parse(path)``, or the value parsed from the same bytes before. A file that
        cannot be keyed is parsed (to raise its error); one that changes while it is parsed
        is parsed, but not cached."""
        try:
            key = (kind, key_of(path))
        except OSError:
            return parse(path)
        with self._lock:
            if key in self._entries:
                self.hits += 1
                self._entries.move_to_end(key)
                return self._entries[key]  # type: ignore[return-value]
            self.misses += 1
        value = parse(path)  # outside the lock: other files parse meanwhile
        try:
            unchanged = key_of(path) == key[1]
        except OSError:
            unchanged = False
        if unchanged:
            with self._lock:
                self._entries[key] = value
                self._entries.move_to_end(key)
                while len(self._entries) > self.maxsize:
                    self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0


PARSED = ParseCache()


def lora_config(adapter_dir: Path) -> LoraConfig:
    """``read_lora_config(adapter_dir)``, parsed once per content of the file."""
    return PARSED.get("lora_config", adapter_dir / CONFIG_NAME, config_key,
                      lambda _: read_lora_config(adapter_dir))


def safetensors_header(path: Path) -> SafetensorsHeader:
    """``read_header(path)``, parsed once per content of the header."""
    return PARSED.get("safetensors_header", path, header_key, read_header)
