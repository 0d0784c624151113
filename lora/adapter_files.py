"""AdapterFiles: the files of one adapter directory, each opened through ``open``, which
confines it to the adapter's root and reads it from one descriptor.

Invariants:
- With a ``root`` (an adapter that came through a server's ``--adapter-root``, resolver or
  upload), a file is opened first and its real path is read back from the open descriptor
  (``/proc/self/fd``; ``F_GETPATH`` on macOS), then checked to lie inside ``root``. A symlink
  that stays inside the root is followed (a Hugging Face cache's snapshots point into its
  blobs/); one that leaves it is refused (``AdapterConfinementError``). There is no window
  between the check and the read: everything read of that file is read from that
  descriptor (or from ``fd_path``, which reopens the same open file, for libraries that want
  a path). Every read of an adapter's files, at registration and again after an eviction,
  goes through here with the root the adapter was registered with.
- Only regular files are read (a FIFO or a device is refused; opened non-blocking, so a
  FIFO cannot hang the reader).
- Messages name the file by ``label``: ``shown`` (how the client named the directory: the
  path it gave, ``<upload NAME>``, ``<resolver NAME>``), never the directory's real path.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..errors import AdapterConfinementError
from .peft_checks import AdapterError

OUTSIDE = ("is a link to a file outside the adapter's directory root; every file of an "
           "adapter loaded through the server must lie inside its root (a symlink that stays "
           "inside is fine)")


@dataclass(frozen=True)
class AdapterFiles:
    dir: Path  # the adapter directory (absolute and resolved when confined)
    root: Path | None = None  # every file opened must lie under it; None: not confined
    shown: str = ""  # how messages name ``dir``; "" = str(dir)

    def label(self, name: str = "") -> str:
        """How a message names the file ``name`` of the directory (or the directory)."""
        shown = self.shown or str(self.dir)
        return f"{shown}/{name}" if name else shown

    @contextmanager
    def open(self, name: str) -> Iterator[BinaryIO]:
        """The file ``name`` of the directory, open for reading, confined to ``root``.
        MissingFile when there is none; AdapterConfinementError when it lies outside the
        root; AdapterError when it cannot be opened or is not a regular file."""
        with open_file(self.dir / name, self.root, self.label(name)) as f:
            yield f

    def inside(self, path: Path) -> bool:
        """Whether ``path`` (followed through its symlinks) lies inside ``root``; always
        True when not confined. Stats the path's parts, opens nothing."""
        return self.root is None or Path(os.path.realpath(path)).is_relative_to(self.root)


@contextmanager
def open_file(path: Path, root: Path | None, label: str) -> Iterator[BinaryIO]:
    """``path`` open for binary reading; with ``root``, the opened file's real path must lie
    under it (module docstring)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise MissingFile(f"{label} is missing") from None
    except OSError as exc:  # its text names the path: the message names the label instead
        raise AdapterError(f"{label} cannot be read: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise AdapterError(f"{label} is not a regular file; it must be a file of the "
                             "adapter directory")
        if root is not None and not opened_path(fd).is_relative_to(root):
            raise AdapterConfinementError(f"{label} {OUTSIDE}")
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


class MissingFile(AdapterError):
    """The adapter directory has no such file (or a dangling symlink of that name)."""


def opened_path(fd: int) -> Path:
    """The real path of the file open as ``fd``, as the kernel knows it."""
    try:
        text = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        text = None
    if text is None:
        import fcntl

        if not hasattr(fcntl, "F_GETPATH"):
            raise AdapterConfinementError(
                "this platform cannot tell which file a descriptor opened (no /proc/self/fd "
                "or F_GETPATH), so adapter files cannot be confined to a root here")
        raw = fcntl.fcntl(fd, fcntl.F_GETPATH, bytes(os.pathconf("/", "PC_PATH_MAX")))
        text = os.fsdecode(raw.split(b"\0", 1)[0])
    return Path(text.removesuffix(" (deleted)"))


def real_path(f: BinaryIO, name: Path) -> str:
    """The real path of the open file ``f`` (opened as ``name``): the kernel's answer, else
    ``name`` resolved (a platform that cannot tell, for an unconfined read)."""
    try:
        return str(opened_path(f.fileno()))
    except AdapterConfinementError:
        return os.path.realpath(name)


def fd_path(f: BinaryIO) -> str:
    """A path that opens the same file as the open file ``f`` (for a library that takes a
    path: safetensors' ``safe_open``), whatever has become of its name since."""
    fd = f.fileno()
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


# The most a JSON config of an adapter dir (adapter_config.json, a base's config.json) may
# hold: real ones are 1-100 KB; a request must not make the server read and parse more.
MAX_CONFIG_FILE_BYTES = 4 << 20


def read_all(f: BinaryIO, where: str, limit: int = MAX_CONFIG_FILE_BYTES,
             what: str = "a config file") -> bytes:
    """The whole file, from its start; AdapterError, before anything is read, if it holds
    more than ``limit`` bytes (its size from the open file; at most ``limit`` + 1 bytes are
    read, should it grow meanwhile). ``what`` names the kind of file in the message."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    raw = f.read(limit + 1) if size <= limit else b""
    if size > limit or len(raw) > limit:
        raise AdapterError(f"{where} is {max(size, len(raw))} bytes, over the {limit} bytes "
                           f"({limit >> 20} MiB) {what} may hold")
    return raw
