"""The serving layer: gRPC servicers and the OpenAI-compatible HTTP front (server/http/) on one
engine, the front-neutral request path, status-code mapping, auth, metrics, start-up and
shutdown."""

from .app import LoraplexServer, serve
from .options import ServerOptions

__all__ = ["LoraplexServer", "ServerOptions", "serve"]
