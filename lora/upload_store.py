"""UploadStore: adapter directories that arrive as bytes or tensors (an upload over gRPC, a
trainer's ``LLMEngine.add_adapter(tensors=...)``) are written as PEFT directories, so that
they go through exactly the checks and reads of an adapter loaded from disk
(``peft_format``), and the host tier can read them again after an eviction.

Invariants: each upload gets a directory of its own (``<root>/<name>-<random>``), never
reused; a directory is complete (config and weights written, closed) before anyone reads
it; ``discard`` removes only directories under the root. With no root given, the root is a
private temporary directory, removed when the store is collected (or the process exits).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from .peft_files import CONFIG_NAME
from .peft_format import WEIGHTS_NAME

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class UploadStore:
    def __init__(self, root: str | Path | None = None):
        self._given = Path(root) if root is not None else None
        self._root: Path | None = None

    @property
    def root(self) -> Path:
        if self._root is None:
            if self._given is not None:
                self._given.mkdir(parents=True, exist_ok=True)
                self._root = self._given.resolve()
            else:
                self._root = Path(tempfile.mkdtemp(prefix="loraplex-uploads-")).resolve()
                weakref.finalize(self, shutil.rmtree, self._root, True)
        return self._root

    def new_dir(self, name: str) -> Path:
        """A fresh, empty directory for one upload of adapter ``name``."""
        return Path(tempfile.mkdtemp(prefix=f"{_UNSAFE.sub('_', name)[:64]}-", dir=self.root))

    def open_weights(self, upload: Path) -> BinaryIO:
        """``upload``'s adapter_model.safetensors (``upload`` from ``new_dir``), open for
        writing: the stream's chunks go there (server/grpc/adapter_upload.py writes and closes it
        off the event loop)."""
        return (upload / WEIGHTS_NAME).open("wb")

    def owns(self, path: str | Path) -> bool:
        return Path(path).resolve().is_relative_to(self.root) and \
            Path(path).resolve() != self.root

    def discard(self, path: str | Path) -> None:
        """Remove an upload's directory (no-op for paths outside the root)."""
        if self._root is not None and self.owns(path):
            shutil.rmtree(path, ignore_errors=True)

    def write_tensors(self, name: str, tensors: Mapping[str, Any], config: Any) -> Path:
        """A PEFT directory holding ``config`` (a dict or a peft ``LoraConfig``) and
        ``tensors`` (PEFT state-dict names -> tensors), as ``save_pretrained`` writes it."""
        from safetensors.torch import save_file

        out = self.new_dir(name)
        try:
            write_config(out, config)
            flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
            save_file(flat, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise
        return out


def config_dict(config: Any) -> dict[str, Any]:
    """A LoRA config as adapter_config.json's object: a dict as given, a peft config's
    ``to_dict()`` (sets become sorted lists, as PEFT writes them)."""
    raw = dict(config) if isinstance(config, Mapping) else config.to_dict()
    return {k: sorted(v) if isinstance(v, set) else
            (str(v.value) if hasattr(v, "value") else v) for k, v in raw.items()}


def write_config(out: Path, config: Any) -> None:
    text = config if isinstance(config, (str, bytes)) else json.dumps(config_dict(config))
    (out / CONFIG_NAME).write_bytes(text.encode() if isinstance(text, str) else text)
