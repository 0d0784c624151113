"""ServerConnection: the one client config, where and how a client reaches a server.

Its fields are the Python clients' keywords (``Client(target, api_token=..., ...)`` builds
one; ``Client.from_config(connection)`` takes one) and, through their Flags (loraplex.flag), the flags of ``loraplex generate --server``,
``adapters``, ``bench`` and the ``python -m loraplex.client health`` probe: config_flags
derives them as it derives the server's, so nothing maps one to the other by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..flag import flag

if TYPE_CHECKING:
    import grpc

CONNECTION = "server connection"
Pem = bytes | str | Path | None  # PEM bytes, or the path of a PEM file


def _pem(value: Pem) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


@dataclass(frozen=True)
class ServerConnection:
    """Where and how to connect. TLS is on when ``tls`` or any certificate is given;
    ``certificate_chain`` + ``private_key`` are the client's own (mutual TLS). ``timeout``
    is the default deadline of every call (None: none), the same on the CLI and in Python;
    the health probe alone waits 5 s by default (``Client.health``, ``python -m
    loraplex.client health``). ``tls`` and ``server_name`` have no flag (the Python API's)."""

    target: str | None = flag(None, group=CONNECTION, name="server", metavar="HOST:PORT",
                              help="a running loraplex server")
    api_token: str | None = flag(None, group=CONNECTION, env="LORAPLEX_API_TOKEN",
                                 help="sent on Inference and ServerInfo (env LORAPLEX_API_TOKEN)")
    admin_token: str | None = flag(None, group=CONNECTION, env="LORAPLEX_ADMIN_TOKEN",
                                   help="sent on AdapterAdmin (env LORAPLEX_ADMIN_TOKEN)")
    tls: bool = False  # TLS with the system's root certificates
    root_certificates: Pem = flag(None, group=CONNECTION, name="ssl-ca-certs",  # noqa: RUF009
                                   kind="path", metavar="PATH",
                                   help="CA of the server certificate (TLS on)")
    certificate_chain: Pem = flag(None, group=CONNECTION, name="ssl-certfile",  # noqa: RUF009
                                   kind="path", metavar="PATH",
                                   help="client certificate (mutual TLS)")
    private_key: Pem = flag(None, group=CONNECTION, name="ssl-keyfile",  # noqa: RUF009
                             kind="path", metavar="PATH",
                             help="client key (mutual TLS)")
    server_name: str | None = None  # the name the server certificate must carry
    timeout: float | None = flag(None, group=CONNECTION,
                                 help="deadline per call, seconds (default: none)")

    @property
    def secure(self) -> bool:
        return self.tls or any(x is not None for x in (
            self.root_certificates, self.certificate_chain, self.private_key))

    def credentials(self) -> grpc.ChannelCredentials:
        import grpc

        return grpc.ssl_channel_credentials(_pem(self.root_certificates), _pem(self.private_key),
                                            _pem(self.certificate_chain))

    def channel_args(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    @staticmethod
    def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {token}"),) if token else ()
