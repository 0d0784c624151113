"""The serving layer: the gRPC front (server/grpc/) and the OpenAI-compatible HTTP front
(server/http/) on one engine; here, the front-neutral request path, the error codes, the auth
rule, metrics, start-up and shutdown (loraplex_server.py).

The exports load lazily: importing a submodule (the Ray adapter registry's actor, say) must
not load the engine and torch with it."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {"LoraplexServer": ".loraplex_server", "serve": ".loraplex_server",
            "ServerOptions": ".server_options"}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from .loraplex_server import LoraplexServer as LoraplexServer
    from .loraplex_server import serve as serve
    from .server_options import ServerOptions as ServerOptions


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'loraplex.server' has no attribute {name!r}")
