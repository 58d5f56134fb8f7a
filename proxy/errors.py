"""OpenAI-style error bodies, and the one exception type the request path raises."""

from __future__ import annotations

import json
from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_body(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            "param": param,
            "code": code or status,
        }
    }


class ProxyError(Exception):
    """Ends a request with an OpenAI-style JSON error.

    ``close``: no keep-alive after the answer (aiohttp still drains an unread body for
    its lingering time, so a client that is still sending can read the answer);
    ``hangup``: close the connection as soon as the answer is written (a client too slow
    to send its body gets no lingering); ``headers``: extra headers (e.g. Retry-After).
    """

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        body: dict[str, Any] | None = None,
        *,
        close: bool = False,
        hangup: bool = False,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = body if body is not None else error_body(status, message, code)
        self.close = close or hangup
        self.hangup = hangup
        self.headers = headers or {}


def from_upstream(leg: str, status: int, content: bytes) -> ProxyError:
    """Map a backend's error reply: client errors keep their status, server errors become 502.

    vLLM already answers in OpenAI's shape; that body is kept so the client sees the
    backend's own message.
    """
    out_status = status if 400 <= status < 500 else 502
    try:
        parsed = json.loads(content)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return ProxyError(out_status, str(parsed["error"].get("message", "")), body=parsed)
    if isinstance(parsed, dict) and "message" in parsed:  # older vLLM: {"object": "error", ...}
        msg = str(parsed["message"])
    else:
        msg = content[:500].decode("utf-8", "replace")
    return ProxyError(out_status, f"{leg} instance answered {status}: {msg}")
