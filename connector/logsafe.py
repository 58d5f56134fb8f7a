"""Make peer- and client-controlled strings safe to log.

Transfer ids carry the client's X-Request-Id and engine ids come from any peer that can
reach the side channel: written raw, a newline forges a log line and an ANSI escape
rewrites a terminal. Secrets must never reach a log at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SECRET_KEYS = frozenset({"transfer_secret", "secret"})
_MAX = 200


def safe(value: object, limit: int = _MAX) -> str:
    """Printable ASCII only: control and non-ASCII characters escaped, long values cut."""
    text = value if isinstance(value, str) else repr(value)
    out = text.encode("ascii", "backslashreplace").decode("ascii")
    out = "".join(c if 32 <= ord(c) < 127 else f"\\x{ord(c):02x}" for c in out)
    return out if len(out) <= limit else out[:limit] + f"...(+{len(out) - limit})"


def redacted(params: object) -> str:
    """kv_transfer_params for a log line: secrets replaced, everything escaped."""
    if not isinstance(params, Mapping):
        return f"<{type(params).__name__}>"
    clean: dict[str, Any] = {
        str(k): ("<redacted>" if k in SECRET_KEYS else v) for k, v in params.items()
    }
    return safe(clean)
