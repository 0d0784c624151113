"""Server credentials for TLS (--ssl-certfile/--ssl-keyfile) and mutual TLS (--ssl-ca-certs)."""

from __future__ import annotations

import grpc

from .server_options import ServerOptions


def server_credentials(options: ServerOptions) -> grpc.ServerCredentials | None:
    """None without TLS; with ``ssl_ca_certs`` clients must present a certificate it signed."""
    if options.ssl_certfile is None or options.ssl_keyfile is None:
        return None
    key = options.ssl_keyfile.read_bytes()
    cert = options.ssl_certfile.read_bytes()
    ca = options.ssl_ca_certs.read_bytes() if options.ssl_ca_certs is not None else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=ca is not None)
