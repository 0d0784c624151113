"""The serving layer: gRPC servicers and the OpenAI-compatible HTTP front (server/http/) on one
engine, the front-neutral request path, status-code mapping, auth, metrics, start-up and
shutdown.

The exports load lazily: importing a submodule (the Ray adapter registry's actor, say) must
not load the engine and torch with it."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {"LoraplexServer": ".app", "serve": ".app", "ServerOptions": ".options"}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from .app import LoraplexServer as LoraplexServer
    from .app import serve as serve
    from .options import ServerOptions as ServerOptions


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'loraplex.server' has no attribute {name!r}")
