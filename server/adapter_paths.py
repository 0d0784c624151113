"""Adapter names and paths, the one rule of every way in: names are canonical (``NAME_RE``,
``check_adapter_name``; ``check_canonical`` for a request's ``model`` / ``adapter``), and a
runtime load by path reads only where the operator allowed (``check_path_loading``,
``confine``).

Invariants: two different accepted names never name one directory (no ``.``, ``..`` or
empty segment, no backslash), so a client cannot register one adapter under many names. A
path a client gives lies inside an ``--adapter-root`` once symlinks and ``..`` are resolved
(the files inside are confined again when opened: lora/adapter_files.py). With no
``--adapter-root``, a server that listens beyond loopback refuses loads by path unless
``--allow-any-adapter-path``. Messages name what the client sent, never the resolved target
or the roots.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Sequence
from pathlib import Path

from .error_code import ErrorCode, ServiceError
from .server_options import ServerOptions

# 1-128 characters of a safe alphabet, starting with a letter or digit; '/'-separated
# segments that are never empty, "." or ".."
NAME_RE = re.compile(r"(?!.*(?:^|/)\.\.?(?:/|\Z))(?!.*//)(?!.*/\Z)"
                     r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
CANONICAL = ("segments between '/' must be non-empty and not '.' or '..', and a name holds "
             "no backslash")
NAME_RULE = (f"1 to 128 characters: letters, digits and . _ - : /, starting with a letter or "
             f"digit; {CANONICAL}")


def segment_problem(name: str) -> str | None:
    """What makes ``name`` non-canonical (two spellings of one directory), or None."""
    if "\\" in name:
        return "holds a backslash"
    segments = name.split("/")
    if any(s in (".", "..") for s in segments):
        return "has a '.' or '..' segment"
    if len(segments) > 1 and "" in segments:
        return "has an empty segment (a leading, trailing or doubled '/')"
    return None


def check_canonical(name: str) -> str:
    """``name`` if it is canonical; ValueError (INVALID_ARGUMENT) if not. What a request's
    ``model`` / ``adapter`` must pass (any other unknown name is NOT_FOUND)."""
    problem = segment_problem(name)
    if problem is not None:
        raise ValueError(f"adapter name {name!r} {problem}; {CANONICAL}")
    return name


def check_adapter_name(name: str, served_model_name: str | None) -> str:
    """``name`` if it may name an adapter; ValueError (INVALID_ARGUMENT) saying why not."""
    if not name:
        raise ValueError(f"adapter name is empty (\"\" is the base model); a name has {NAME_RULE}")
    if not NAME_RE.fullmatch(name):
        problem = segment_problem(name) or "is not allowed"
        raise ValueError(f"adapter name {name!r} {problem}; a name has {NAME_RULE}")
    if served_model_name is not None and name == served_model_name:
        raise ValueError(f"adapter name {name!r} is the served model name (the base model); "
                         "choose another")
    return name


def confine(path: str, roots: Sequence[Path]) -> tuple[Path, Path | None]:
    """(``path`` resolved, the root it lies under: None when ``roots`` is empty);
    PERMISSION_DENIED if ``roots`` are set and it is outside them. Resolving first means a
    symlink or ``..`` cannot lead out of a root."""
    if not path:
        raise ValueError("adapter path is empty: give the PEFT adapter directory")
    # realpath: a symlink loop gives a path (whose open then fails), not an exception
    resolved = Path(os.path.realpath(Path(path).expanduser()))
    if not roots:
        return resolved, None
    root = next((r for r in roots if resolved.is_relative_to(r)), None)
    if root is None:
        raise ServiceError(ErrorCode.PERMISSION_DENIED,
                           f"adapter path {path!r} is outside the adapter roots (or leads out "
                           "of them through a symlink or '..'); give a directory under one of "
                           "the server's --adapter-root directories")
    return resolved, root


PATH_LOADING_OFF = (
    "loading an adapter by path is off on this server: it listens beyond loopback and was "
    "started without --adapter-root, and a runtime load by path must be an explicit choice; "
    "restart it with --adapter-root DIR (paths under DIR only) or --allow-any-adapter-path "
    "(any path the server can read), or send the adapter with UploadAdapter")


def check_path_loading(options: ServerOptions, exposed: bool) -> None:
    """PERMISSION_DENIED when a runtime load by path is off: the server listens beyond
    loopback (``exposed``) with neither ``--adapter-root`` nor ``--allow-any-adapter-path``."""
    if exposed and not options.adapter_roots and not options.allow_any_adapter_path:
        raise ServiceError(ErrorCode.PERMISSION_DENIED, PATH_LOADING_OFF)


def path_loading_warning(options: ServerOptions, exposed: bool) -> str | None:
    """The start-up warning of a server that listens beyond loopback with runtime loading by
    path unconfined, or off; None when there is nothing to warn of."""
    if not exposed or options.adapter_roots:
        return None
    if options.allow_any_adapter_path:
        return ("listening beyond loopback with --allow-any-adapter-path and no "
                "--adapter-root: LoadAdapter and /v1/load_lora_adapter read ANY path this "
                "process can read; give --adapter-root DIR to confine them")
    return ("listening beyond loopback without --adapter-root: runtime loading by path "
            "(LoadAdapter, /v1/load_lora_adapter) is off; give --adapter-root DIR to allow "
            "paths under DIR, or --allow-any-adapter-path to allow any path")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is loopback only: every address it resolves
    to is (127.0.0.0/8, ::1). A name that does not resolve counts as not loopback."""
    bare = host.strip("[]")
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(found) and all(ipaddress.ip_address(f[4][0].split("%")[0]).is_loopback
                               for f in found)
