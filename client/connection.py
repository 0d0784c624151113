"""ServerConnection: how ``loraplex generate --server``, ``adapters`` and ``bench`` reach a
running server; its fields declare their flags (loraplex.flag)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..flag import flag

if TYPE_CHECKING:
    from .grpc_client import Client

CONNECTION = "server connection"


@dataclass(frozen=True)
class ServerConnection:
    server: str | None = flag(None, group=CONNECTION, metavar="HOST:PORT",
                              help="a running loraplex server")
    api_token: str | None = flag(None, group=CONNECTION, env="LORAPLEX_API_TOKEN",
                                 help="sent on Inference and ServerInfo (env LORAPLEX_API_TOKEN)")
    admin_token: str | None = flag(None, group=CONNECTION, env="LORAPLEX_ADMIN_TOKEN",
                                   help="sent on AdapterAdmin (env LORAPLEX_ADMIN_TOKEN)")
    ssl_ca_certs: Path | None = flag(None, group=CONNECTION,  # noqa: RUF009
                                     help="CA of the server certificate (TLS on)")
    ssl_certfile: Path | None = flag(None, group=CONNECTION,  # noqa: RUF009
                                     help="client certificate (mutual TLS)")
    ssl_keyfile: Path | None = flag(None, group=CONNECTION,  # noqa: RUF009
                                    help="client key (mutual TLS)")
    timeout: float | None = flag(None, group=CONNECTION, help="deadline per call, seconds")

    def client(self) -> Client:
        from .grpc_client import Client

        if self.server is None:
            raise ValueError("no server to connect to: give --server HOST:PORT")
        return Client(self.server, api_token=self.api_token, admin_token=self.admin_token,
                      root_certificates=self.ssl_ca_certs, certificate_chain=self.ssl_certfile,
                      private_key=self.ssl_keyfile, timeout=self.timeout)
