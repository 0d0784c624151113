"""Bearer-token auth: the rule both fronts share (``required_tokens``, ``refusal``),
front-neutral; server/grpc_auth.py applies it to gRPC calls, server/http/auth.py to HTTP
routes.

AdapterAdmin needs the admin token when one is set; Inference and ServerInfo need the API
token when one is set (the admin token is accepted there too). Health and reflection stay
open so that load balancers and grpcurl can probe without secrets.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Sequence


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` header, if there is one."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _matches(token: str | None, accepted: Sequence[str]) -> bool:
    # compare_digest on every candidate: the time taken does not reveal which one is close
    hits = [hmac.compare_digest(token.encode(), a.encode()) for a in accepted] if token else []
    return any(hits)


class Scope(enum.Enum):
    ADMIN = "admin"  # adapter load / unload
    API = "api"  # inference and server info
    OPEN = "open"  # health, reflection, version, metrics


def required_tokens(scope: Scope, api_token: str | None, admin_token: str | None
                    ) -> tuple[str, list[str]] | None:
    """(the flag that sets the token, the tokens accepted) for ``scope``; None if open.
    The one rule of both fronts: admin calls need --admin-token when it is set; API calls
    need --api-token when it is set, and take the admin token too."""
    if scope is Scope.ADMIN and admin_token is not None:
        return "--admin-token", [admin_token]
    if scope is Scope.API and api_token is not None:
        return "--api-token", [t for t in (api_token, admin_token) if t]
    return None


def refusal(token: str | None, scope: Scope, api_token: str | None, admin_token: str | None,
            what: str) -> str | None:
    """Why ``token`` may not call ``what`` (UNAUTHENTICATED), or None if it may."""
    required = required_tokens(scope, api_token, admin_token)
    if required is None:
        return None
    flag, accepted = required
    if _matches(token, accepted):
        return None
    why = "no bearer token was sent" if token is None else "the bearer token is wrong"
    return f"{what} needs authorization: Bearer <token> with the server's {flag}; {why}"
