"""Log lines nobody can forge, and request ids that are safe to pass on.

Client-controlled strings (X-Request-Id, URLs, a backend's echo of the client's input)
reach the proxy's logs; written raw, a newline forges a log line and an ANSI escape
rewrites an operator's terminal. Every proxy logger gets :class:`EscapeFilter`, which
escapes the final message of each record, so no call site can forget it. Secrets
(``transfer_secret``) are never passed to a logger at all; :func:`redact` scrubs a known
secret out of text a backend sent back.
"""

from __future__ import annotations

import logging
import re
import traceback
import uuid

MAX_REQUEST_ID = 128
# Ids pass through to both vLLM instances, the connector's transfer ids and their logs:
# letters, digits and . _ : - only.
_REQUEST_ID = re.compile(rf"[A-Za-z0-9._:\-]{{1,{MAX_REQUEST_ID}}}")
# C0 and C1 controls, DEL, Unicode line/paragraph separators and bidi overrides.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
MAX_LOG_CHARS = 4000


def _esc(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def escape(text: object, limit: int = MAX_LOG_CHARS) -> str:
    """``text`` as one printable line: control characters escaped, long text cut."""
    s = text if isinstance(text, str) else str(text)
    s = _UNSAFE.sub(_esc, s)
    return s if len(s) <= limit else f"{s[:limit]}...(+{len(s) - limit} chars)"


def request_id(header: str | None) -> tuple[str, bool]:
    """(the id to use, whether the client's was accepted): a missing or unsafe
    X-Request-Id (too long, characters outside ``[A-Za-z0-9._:-]``) is replaced."""
    rid = (header or "").strip()
    if rid and _REQUEST_ID.fullmatch(rid):
        return rid, True
    return uuid.uuid4().hex, False


def redact(data: bytes, secret: object) -> bytes:
    """``data`` with every occurrence of ``secret`` replaced (a backend echoing the
    request it got must not hand the transfer secret to a client or a log)."""
    if not isinstance(secret, str) or not secret:
        return data
    return data.replace(secret.encode(), b"<redacted>")


def one_line_exception(exc: BaseException) -> str:
    """A traceback as one escaped line (exception texts can carry client input)."""
    return escape("".join(traceback.format_exception(exc)), 16000)


class EscapeFilter(logging.Filter):
    """Escapes each record's final message (arguments merged) before any handler; an
    attached exception becomes part of that one line (its text may quote a client)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        limit = MAX_LOG_CHARS
        if record.exc_info and record.exc_info[1] is not None:
            msg = f"{msg}: {''.join(traceback.format_exception(record.exc_info[1]))}"
            record.exc_info, record.exc_text, limit = None, None, 4 * MAX_LOG_CHARS
        clean = escape(msg, limit)
        if clean != msg or record.args:
            record.msg, record.args = clean, None
        return True


class ClientErrorFilter(logging.Filter):
    """aiohttp logs every malformed request (the client's fault) at ERROR with a
    traceback: any client could flood the log. Those become DEBUG lines."""

    def __init__(self, client_errors: tuple[type[BaseException], ...]) -> None:
        super().__init__()
        self._types = client_errors

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or not isinstance(exc, self._types):
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


_FILTER = EscapeFilter()


def get_logger(name: str, *first: logging.Filter) -> logging.Logger:
    """``logging.getLogger(name)`` with ``first`` filters and then the escaping filter
    attached (once each)."""
    log = logging.getLogger(name)
    for f in (*first, _FILTER):
        if f not in log.filters:
            log.addFilter(f)
    return log
