"""The HTTP client to vLLM instances: one pooled aiohttp session, every wait bounded.

aiohttp, not httpx: measured on this machine, httpx's connection-pool bookkeeping cost
~3-4 ms of CPU per proxied request and capped a proxy at ~300 streamed requests/s;
aiohttp's client is ~6x cheaper (see README, design). Bodies are sent and relayed as raw
bytes; streamed chunks are never parsed.

Transport failures raise :class:`UpstreamFailure` (retryable: nothing reached the client);
the request path turns the last one into an OpenAI-style error: unreachable -> 502,
too slow -> 504.
"""

from __future__ import annotations

import asyncio
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


class IdleTimeout(Exception):
    pass


class Upstream:
    def __init__(self, timeouts: Timeouts, max_connections: int) -> None:
        self._t = timeouts
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0,
                limit_per_host=max_connections,
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
        return UpstreamFailure(
            "broken", ProxyError(502, f"{leg} instance {base} failed: {exc!r}", "upstream_error")
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
        try:
            async with asyncio.timeout(limit_s):
                async with self.session.post(base + path, data=data, headers=headers) as resp:
                    return resp.status, await resp.read(), resp.content_type
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise self._fail(leg, base, exc, limit_s) from exc

    async def open_stream(
        self, leg: str, base: str, path: str, data: bytes, headers: dict[str, str]
    ) -> UpstreamStream:
        """POST a streaming request and wait for the first body byte (decode timeout).

        Returns an open stream on 200 (the caller must ``close()`` it), or raises
        UpstreamFailure / ProxyError (the backend's own error status).
        """
        limit = self._t.decode_s
        resp: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(limit):
                resp = await self.session.post(base + path, data=data, headers=headers)
                if resp.status != 200:
                    body = await resp.read()
                    resp.release()
                    return UpstreamStream.failed(resp.status, body)
                first = await resp.content.readany()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if resp is not None:
                resp.close()
            raise self._fail(leg, base, exc, limit) from exc
        except BaseException:
            if resp is not None:
                resp.close()
            raise
        if not first:
            resp.close()
            raise UpstreamFailure(
                "broken",
                ProxyError(
                    502, f"{leg} instance {base} ended the stream before any data", "upstream_error"
                ),
            )
        return UpstreamStream(resp, first, self._t.idle_s)

    async def get(self, base: str, path: str, headers: dict[str, str], limit_s: float):
        async with asyncio.timeout(limit_s):
            async with self.session.get(base + path, headers=headers) as resp:
                return resp.status, await resp.read()


class UpstreamStream:
    """An open streamed response: the first chunk, then ``read()`` until b"".

    The idle timeout is one timer per stream, re-armed lazily from the time of the last
    chunk (no per-chunk timer objects); when it fires it fails the pending read.
    """

    __slots__ = ("_handle", "_idle_s", "_last", "_loop", "done", "first", "resp", "status")

    def __init__(self, resp: aiohttp.ClientResponse | None, first: bytes, idle_s: float) -> None:
        self.resp, self.first, self._idle_s = resp, first, idle_s
        self.status = 200 if resp is not None else 0
        self.done = False
        self._handle: asyncio.TimerHandle | None = None
        if resp is not None:
            self._loop = asyncio.get_running_loop()
            self._last = self._loop.time()
            self._handle = self._loop.call_at(self._last + idle_s, self._check_idle)

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
        if now - self._last >= self._idle_s:
            self.resp.content.set_exception(IdleTimeout())
        else:
            self._handle = self._loop.call_at(self._last + self._idle_s, self._check_idle)

    async def read(self) -> bytes:
        assert self.resp is not None
        chunk = await self.resp.content.readany()
        self._last = self._loop.time()
        if not chunk:
            self.done = True
        return chunk

    def close(self) -> None:
        """Finished: the connection goes back to the pool; unfinished: it is closed, which
        makes vLLM abort the request at once."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self.resp is None:
            return
        if self.done:
            self.resp.release()
        else:
            self.resp.close()
        self.done = True
