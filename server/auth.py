"""Bearer-token auth: the rule both fronts share (``required_tokens``, ``refusal``),
front-neutral; server/grpc/auth_interceptor.py applies it to gRPC calls,
server/http/route_auth.py to HTTP routes, server/ray/context.py to Ray's gRPC proxy.

The one rule: with no token set, every route is open. When any token is set, every route
except health (gRPC Health, HTTP /health and /ping), gRPC reflection and /metrics needs
one: admin routes (AdapterAdmin, /v1/load_lora_adapter, /v1/unload_lora_adapter,
/reset_prefix_cache) the admin token when ``--admin-token`` is set, else the API token; every
other route (inference, models, tokenizer, server info, /version) the API token or the admin
token. Open routes stay open so that load balancers, probes, Prometheus and grpcurl need no
secret.
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
    ADMIN = "admin"  # adapter load / unload / upload, prefix-cache reset
    API = "api"  # everything else that is not OPEN: inference, info, models, tokenizer
    OPEN = "open"  # health, reflection, metrics


def required_tokens(scope: Scope, api_token: str | None, admin_token: str | None
                    ) -> tuple[str, list[str]] | None:
    """(the flag that sets the token asked for, the tokens accepted) for ``scope``; None if
    the scope is open (module docstring: the one rule of both fronts)."""
    if scope is Scope.OPEN or (api_token is None and admin_token is None):
        return None
    accepted = [t for t in (api_token, admin_token) if t is not None]
    if scope is Scope.ADMIN:
        return ("--admin-token", [admin_token]) if admin_token is not None else \
            ("--api-token", accepted)
    return ("--api-token" if api_token is not None else "--admin-token"), accepted


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
