"""Client connection limits aiohttp does not have: a header read timeout, a cap on open
connections, and a timeout on writes to a client that stopped reading.

aiohttp's server closes a connection only after ``keepalive_timeout`` while it waits for a
request, and never while it writes; so a client sending its headers one byte at a time
(slowloris), or one that stops reading a stream, holds a connection (and, for a stream,
an upstream connection and the decoder's request) indefinitely.

- :class:`ConnectionGuard` wraps aiohttp's protocol factory. Each connection is in one of
  three states: waiting for headers (from connect, or from the first byte after the
  previous request), in a request (from the moment the handler runs), or idle (after it;
  aiohttp's keep-alive timeout governs idle). Headers not complete within
  ``header_timeout_s`` close the connection. Beyond ``max_connections`` a new connection
  is answered 503 and closed.
- :class:`GuardedSite` is aiohttp's TCP site listening through the guard.
- :class:`WriteDeadline` is one timer per response (no per-write timer objects): a write
  blocked for ``limit_s`` aborts the client connection, which cancels the handler, which
  closes the upstream stream (vLLM aborts the request and frees its KV).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from proxy.errors import error_body
from proxy.logsafe import get_logger

logger = get_logger("proxy.clientguard")

_HEADERS, _REQUEST, _IDLE = 0, 1, 2


def _canned(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps(error_body(status, message, code)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class ConnectionGuard:
    def __init__(
        self,
        max_connections: int,
        header_timeout_s: float,
        on_limit: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self._on_limit = on_limit
        self._conns: dict[Any, _GuardedProtocol] = {}
        self._full = _canned(
            503,
            "Service Unavailable",
            f"proxy overloaded: {max_connections} client connections open",
            "too_many_connections",
        )

    @property
    def active(self) -> int:
        return len(self._conns)

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server`` around aiohttp's."""
        return lambda: _GuardedProtocol(self, factory)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The outermost middleware: marks the connection's request start and end."""
        conn = self._conns.get(request.transport)
        if conn is not None:
            conn.request_started()
        try:
            return await handler(request)
        finally:
            if conn is not None:
                conn.request_done()

    def close_waiting(self) -> int:
        """Shutdown: close every connection with no request being handled (idle ones, and
        those still sending headers) at once instead of after the grace period."""
        waiting = [c for c in self._conns.values() if c.state != _REQUEST]
        for c in waiting:
            c.close()
        return len(waiting)


class _GuardedProtocol(asyncio.Protocol):
    """Forwards everything to aiohttp's protocol; owns the header timer."""

    __slots__ = ("_factory", "_guard", "_inner", "_timer", "_transport", "state")

    def __init__(self, guard: ConnectionGuard, factory: Callable[[], asyncio.Protocol]) -> None:
        self._guard = guard
        self._factory = factory
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.state = _HEADERS

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        g = self._guard
        self._transport = transport  # type: ignore[assignment]
        if len(g._conns) >= g.max_connections:
            g._on_limit("connections")
            self._reject(transport)  # type: ignore[arg-type]
            return
        g._conns[transport] = self
        self._inner = self._factory()
        self._inner.connection_made(transport)
        self._arm()

    def _reject(self, transport: asyncio.Transport) -> None:
        transport.write(self._guard._full)
        if transport.can_write_eof():
            transport.write_eof()
        # Let the client read the answer before the socket goes (closing with its request
        # unread would reset the connection); bounded, and the request is discarded.
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(1.0, transport.close)

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._guard.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _headers_late(self) -> None:
        self._timer = None
        if self.state == _HEADERS and self._transport is not None:
            self._guard._on_limit("header_timeout")
            if logger.isEnabledFor(logging.DEBUG):
                peer = self._transport.get_extra_info("peername")
                logger.debug("closing %s: no complete request headers in time", peer)
            self._transport.close()

    def request_started(self) -> None:
        self.state = _REQUEST
        self._disarm()

    def request_done(self) -> None:
        self.state = _IDLE

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        inner = self._inner
        if inner is None:  # a rejected connection: its request is discarded
            return
        if self.state == _IDLE:  # the next request on a kept-alive connection begins
            self.state = _HEADERS
            self._arm()
        inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._inner is not None:
            self._guard._conns.pop(self._transport, None)
            self._inner.connection_lost(exc)
            self._inner = None
        self._transport = None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()


class GuardedSite(web.BaseSite):
    """aiohttp's TCPSite, with every connection going through a :class:`ConnectionGuard`."""

    __slots__ = ("_guard", "_host", "_port")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        guard: ConnectionGuard,
        *,
        backlog: int = 1024,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._guard = host, port, guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._guard.wrap(server),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
        )


class WriteDeadline:
    """Aborts the client connection when one write to it stays blocked for ``limit_s``.

    One timer per response, re-armed lazily; each write only stores a timestamp.
    ``on_expire`` runs just before the abort (to record why the request ended).
    """

    __slots__ = ("_handle", "_limit", "_loop", "_on_expire", "_since", "_transport", "expired")

    def __init__(
        self, request: web.BaseRequest, limit_s: float, on_expire: Callable[[], None]
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._transport = request.transport
        self._limit = limit_s
        self._on_expire = on_expire
        self._since: float | None = None
        self.expired = False
        self._handle: asyncio.TimerHandle | None = self._loop.call_at(
            self._loop.time() + limit_s, self._check
        )

    def _check(self) -> None:
        self._handle = None
        now = self._loop.time()
        since = self._since
        if since is not None and now - since >= self._limit:
            self.expired = True
            self._on_expire()
            if self._transport is not None:
                self._transport.abort()
            return
        base = since if since is not None else now
        self._handle = self._loop.call_at(base + self._limit, self._check)

    async def prepare(self, resp: web.StreamResponse, request: web.BaseRequest) -> None:
        self._since = self._loop.time()
        try:
            await resp.prepare(request)
        finally:
            self._since = None

    async def write(self, resp: web.StreamResponse, data: bytes) -> None:
        self._since = self._loop.time()
        try:
            await resp.write(data)
        finally:
            self._since = None

    async def write_eof(self, resp: web.StreamResponse) -> None:
        self._since = self._loop.time()
        try:
            await resp.write_eof()
        finally:
            self._since = None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
