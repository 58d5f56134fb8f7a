"""Client and admin authentication, and the credentials sent to the backends (pure)."""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence


def bearer(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization") or headers.get("Authorization")
    if not auth:
        return None
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def key_ok(token: str | None, keys: Sequence[str]) -> bool:
    """Constant-time check of a bearer token against accepted keys (all are compared)."""
    if token is None:
        return False
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(token.encode(), k.encode())
    return ok


def client_allowed(headers: Mapping[str, str], api_keys: Sequence[str]) -> bool:
    return not api_keys or key_ok(bearer(headers), api_keys)


def backend_headers(
    client_headers: Mapping[str, str],
    request_id: str,
    mode: str = "passthrough",
    backend_key: str | None = None,
) -> dict[str, str]:
    """What the backends see: JSON, the shared request id, and the configured credentials.

    ``passthrough``: the client's Authorization as is; ``key``: the proxy's backend key;
    ``none``: no credentials.
    """
    out = {"content-type": "application/json", "x-request-id": request_id}
    if mode == "passthrough":
        auth = client_headers.get("authorization") or client_headers.get("Authorization")
        if auth:
            out["authorization"] = auth
    elif mode == "key" and backend_key:
        out["authorization"] = f"Bearer {backend_key}"
    return out
