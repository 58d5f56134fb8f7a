"""The HTTP client to vLLM instances: one pooled aiohttp session, every wait bounded.

aiohttp, not httpx: measured on this machine, httpx's connection-pool bookkeeping cost
~3-4 ms of CPU per proxied request and capped a proxy at ~300 streamed requests/s;
aiohttp's client is ~6x cheaper (see README, design). Bodies are sent and relayed as raw
bytes; streamed chunks are never parsed.

Transport failures raise :class:`UpstreamFailure` (retryable: nothing reached the client);
the request path turns the last one into an OpenAI-style error: unreachable -> 502,
too slow -> 504.

Each instance has ``max_connections`` slots for request legs, counted here rather than by
aiohttp's pool: aiohttp counts its wait for a free pooled connection inside the connect
timeout, so a pool filled by slow clients looked like an unreachable decoder (502, and the
breaker opened for everyone). Waiting for a slot longer than ``pool_wait_s`` raises
:class:`Overloaded` (503 "proxy overloaded"), which is nobody's failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from proxy.errors import ProxyError
from proxy.settings import Timeouts


@dataclass
class UpstreamFailure(Exception):
    """A leg failed before anything reached the client: safe to retry elsewhere."""

    kind: str  # unreachable | timeout | broken | status_5xx
    error: ProxyError

    def __str__(self) -> str:
        return f"{self.kind}: {self.error}"


def describe(exc: BaseException) -> str:
    """An exception as ``Type: message``, without the request it may carry."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class IdleTimeout(Exception):
    pass


class Overloaded(Exception):
    """Every slot to an instance stayed busy for ``pool_wait_s``: the proxy is saturated,
    the instance did nothing wrong (never counted against its breaker)."""

    def __init__(self, leg: str, base: str, slots: int, wait_s: float) -> None:
        self.error = ProxyError(
            503,
            f"proxy overloaded: all {slots} connections to {leg} instance {base} stayed busy "
            f"for {wait_s:g}s; retry later",
            "proxy_overloaded",
            headers={"retry-after": "1"},
        )
        super().__init__(str(self.error))


class Upstream:
    def __init__(self, timeouts: Timeouts, max_connections: int) -> None:
        self._t = timeouts
        self._max = max_connections
        self._slots: dict[str, asyncio.Semaphore] = {}
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                # Unbounded here: legs are bounded by the slots, so aiohttp never queues.
                limit=0,
                limit_per_host=0,
                keepalive_timeout=60.0,
                ttl_dns_cache=None,
            ),
            timeout=aiohttp.ClientTimeout(
                total=None, connect=timeouts.connect_s, sock_connect=timeouts.connect_s
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def aclose(self) -> None:
        await self.session.close()

    async def _acquire(self, leg: str, base: str) -> Callable[[], None]:
        """A slot to ``base`` (its release function), or :class:`Overloaded`."""
        sem = self._slots.get(base)
        if sem is None:
            sem = self._slots[base] = asyncio.Semaphore(self._max)
        if sem.locked():
            try:
                async with asyncio.timeout(self._t.pool_wait_s):
                    await sem.acquire()
            except TimeoutError:
                raise Overloaded(leg, base, self._max, self._t.pool_wait_s) from None
        else:
            await sem.acquire()  # free: returns at once
        return sem.release

    def _fail(self, leg: str, base: str, exc: BaseException, limit_s: float) -> UpstreamFailure:
        if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
            return UpstreamFailure(
                "unreachable",
                ProxyError(
                    502, f"{leg} instance {base} is unreachable: {exc}", "upstream_unreachable"
                ),
            )
        if isinstance(exc, TimeoutError):
            return UpstreamFailure(
                "timeout",
                ProxyError(
                    504,
                    f"{leg} instance {base} did not answer within {limit_s:g}s",
                    "upstream_timeout",
                ),
            )
        # Never repr(): aiohttp's response errors carry the request's headers, and with
        # them the Authorization sent to the backend.
        return UpstreamFailure(
            "broken",
            ProxyError(502, f"{leg} instance {base} failed: {describe(exc)}", "upstream_error"),
        )

    async def post(
        self,
        leg: str,
        base: str,
        path: str,
        data: bytes,
        headers: dict[str, str],
        limit_s: float,
    ) -> tuple[int, bytes, str]:
        """POST and read the whole answer within ``limit_s``: (status, body, content type)."""
        release = await self._acquire(leg, base)
        try:
            async with asyncio.timeout(limit_s):
                async with self.session.post(base + path, data=data, headers=headers) as resp:
                    return resp.status, await resp.read(), resp.content_type
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise self._fail(leg, base, exc, limit_s) from exc
        finally:
            release()

    async def open_stream(
        self, leg: str, base: str, path: str, data: bytes, headers: dict[str, str]
    ) -> UpstreamStream:
        """POST a streaming request and wait for the first body byte (decode timeout).

        Returns an open stream on 200 (the caller must ``close()`` it), or raises
        UpstreamFailure / ProxyError (the backend's own error status).
        """
        limit = self._t.decode_s
        release = await self._acquire(leg, base)
        resp: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(limit):
                resp = await self.session.post(base + path, data=data, headers=headers)
                if resp.status != 200:
                    body = await resp.read()
                    resp.release()
                    release()
                    return UpstreamStream.failed(resp.status, body)
                first = await resp.content.readany()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if resp is not None:
                resp.close()
            release()
            raise self._fail(leg, base, exc, limit) from exc
        except BaseException:
            if resp is not None:
                resp.close()
            release()
            raise
        if not first:
            resp.close()
            release()
            raise UpstreamFailure(
                "broken",
                ProxyError(
                    502, f"{leg} instance {base} ended the stream before any data", "upstream_error"
                ),
            )
        return UpstreamStream(resp, first, self._t.idle_s, release)

    async def get(
        self,
        base: str,
        path: str,
        headers: dict[str, str],
        limit_s: float,
        leg: str | None = None,
    ):
        """GET within ``limit_s``; ``leg``: a client's request, which takes a slot (health
        checks do not, so a busy instance is not marked down)."""
        release = await self._acquire(leg, base) if leg else None
        try:
            async with asyncio.timeout(limit_s):
                async with self.session.get(base + path, headers=headers) as resp:
                    return resp.status, await resp.read()
        finally:
            if release is not None:
                release()


class UpstreamStream:
    """An open streamed response: the first chunk, then ``read()`` until b"".

    The idle timeout is one timer per stream, re-armed lazily (no per-chunk timer
    objects); when it fires it fails the pending read. Only time spent waiting in
    ``read()`` counts: while the proxy is blocked writing to a slow client the decoder's
    chunks wait in the socket, and that silence is not the decoder's.
    """

    __slots__ = (
        "_handle",
        "_idle_s",
        "_loop",
        "_reading",
        "_release",
        "_since",
        "done",
        "first",
        "resp",
        "status",
    )

    def __init__(
        self,
        resp: aiohttp.ClientResponse | None,
        first: bytes,
        idle_s: float,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.resp, self.first, self._idle_s = resp, first, idle_s
        self._release = release
        self.status = 200 if resp is not None else 0
        self.done = False
        self._reading = False
        self._handle: asyncio.TimerHandle | None = None
        if resp is not None:
            self._loop = asyncio.get_running_loop()
            self._since = self._loop.time()
            self._handle = self._loop.call_at(self._since + idle_s, self._check_idle)

    @classmethod
    def failed(cls, status: int, body: bytes) -> UpstreamStream:
        s = cls(None, body, 0)
        s.status = status
        return s

    def _check_idle(self) -> None:
        self._handle = None
        if self.done or self.resp is None:
            return
        now = self._loop.time()
        if not self._reading:  # the proxy is busy writing to the client
            self._handle = self._loop.call_at(now + self._idle_s, self._check_idle)
        elif now - self._since >= self._idle_s:
            self.resp.content.set_exception(IdleTimeout())
        else:
            self._handle = self._loop.call_at(self._since + self._idle_s, self._check_idle)

    async def read(self) -> bytes:
        assert self.resp is not None
        self._since = self._loop.time()
        self._reading = True
        try:
            chunk = await self.resp.content.readany()
        finally:
            self._reading = False
        if not chunk:
            self.done = True
        return chunk

    def close(self) -> None:
        """Finished: the connection goes back to the pool; unfinished: it is closed, which
        makes vLLM abort the request at once."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._release is not None:
            self._release()
            self._release = None
        if self.resp is None:
            return
        if self.done:
            self.resp.release()
        else:
            self.resp.close()
        self.done = True
