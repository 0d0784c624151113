"""The gRPC serving layer: servicers, status-code mapping, auth, start-up and shutdown."""

from .app import LoraplexServer, serve
from .options import ServerOptions

__all__ = ["LoraplexServer", "ServerOptions", "serve"]
