"""Adapter names and paths that LoadAdapter accepts: names of a safe alphabet, and paths
inside the ``--adapter-root`` folders once symlinks and ``..`` are resolved."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from .error_code import ErrorCode, ServiceError

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
NAME_RULE = ("1 to 128 characters: letters, digits and . _ - : /, starting with a letter or "
             "digit")


def check_adapter_name(name: str, served_model_name: str | None) -> str:
    """``name`` if it may name an adapter; ValueError (INVALID_ARGUMENT) saying why not."""
    if not name:
        raise ValueError(f"adapter name is empty (\"\" is the base model); a name has {NAME_RULE}")
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"adapter name {name!r} is not allowed; a name has {NAME_RULE}")
    if served_model_name is not None and name == served_model_name:
        raise ValueError(f"adapter name {name!r} is the served model name (the base model); "
                         "choose another")
    return name


def confine(path: str, roots: Sequence[Path]) -> Path:
    """The resolved ``path``; PERMISSION_DENIED if ``roots`` are set and it is outside them.
    Resolving first means a symlink or ``..`` cannot lead out of a root."""
    if not path:
        raise ValueError("adapter path is empty: give the PEFT adapter directory")
    resolved = Path(path).expanduser().resolve()
    if roots and not any(resolved.is_relative_to(root) for root in roots):
        allowed = ", ".join(str(r) for r in roots)
        raise ServiceError(ErrorCode.PERMISSION_DENIED,
                           f"adapter path {path!r} resolves to {resolved}, outside the adapter "
                           f"roots; allowed: paths under {allowed}")
    return resolved
