"""A GGUF file's config and tokenizer, built by transformers once per file version and kept
as Hugging Face files under ``loraplex_home()/models/gguf-meta-<name>-<key>``.

Building them reads the whole file's metadata through gguf-py (tens of thousands of
vocabulary strings, parsed in Python) three times (transformers' config, its tokenizer,
our checks): seconds that every start would pay again. The kept copy is keyed by the
file's path, size and mtime (a changed file is parsed anew), written in a temp dir and
renamed into place under a file lock: complete or absent. Where the cache cannot be
written (a read-only home), the file is parsed every time and a warning says so.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from .default_gguf import gguf_cache_dir
from .models.gguf_model import load_gguf_config, load_gguf_tokenizer

log = logging.getLogger(__name__)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_gguf_metadata(path: Path) -> tuple[PretrainedConfig, object | None]:
    """``path``'s config and tokenizer (None when the file carries none), from the kept
    copy when there is one, else from the file (then kept)."""
    meta = gguf_cache_dir(path, "gguf-meta")
    if (meta / "config.json").is_file():
        return _read(meta, path)
    config, tokenizer = load_gguf_config(path), load_gguf_tokenizer(path)
    try:
        _keep(meta, config, tokenizer)
    except OSError as e:
        log.warning("%s: its config and tokenizer could not be kept in %s (%s): the file "
                    "is parsed again at every start", path, meta.parent, e)
    return config, tokenizer


def _read(meta: Path, path: Path) -> tuple[PretrainedConfig, object | None]:
    config = AutoConfig.from_pretrained(meta)
    if not all((meta / name).is_file() for name in _TOKENIZER_FILES):
        log.warning("%s has no tokenizer: requests must give token ids", path)
        return config, None
    return config, AutoTokenizer.from_pretrained(meta)


def _keep(meta: Path, config: PretrainedConfig, tokenizer: object | None) -> None:
    meta = meta.resolve()  # a link (a store shared by homes) is filled where it points
    meta.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(meta.parent / f".{meta.name}.lock")):
        if (meta / "config.json").is_file():
            return
        work = Path(tempfile.mkdtemp(prefix=f".{meta.name}.tmp-", dir=meta.parent))
        try:
            out = work / "meta"
            out.mkdir()
            if tokenizer is not None:
                tokenizer.save_pretrained(str(out))
            config.save_pretrained(str(out))
            os.replace(out, meta)
        finally:
            shutil.rmtree(work, ignore_errors=True)
