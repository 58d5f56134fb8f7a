"""The HTTP client to vLLM instances: one pooled httpx client, every wait bounded.

Transport failures become :class:`ProxyError` here, so the request path deals only in
OpenAI-style errors: unreachable -> 502, too slow -> 504.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from proxy.errors import ProxyError, from_upstream
from proxy.settings import Timeouts


class Upstream:
    def __init__(self, timeouts: Timeouts, max_connections: int) -> None:
        self._t = timeouts
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=60.0,
            ),
            timeout=httpx.Timeout(
                connect=timeouts.connect_s,
                read=timeouts.idle_s,
                write=timeouts.connect_s,
                pool=timeouts.connect_s,
            ),
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    def _timeout(self, read_s: float) -> httpx.Timeout:
        t = self._t
        return httpx.Timeout(connect=t.connect_s, read=read_s, write=t.connect_s, pool=t.connect_s)

    @staticmethod
    def _fail(leg: str, base: str, exc: Exception, limit_s: float) -> ProxyError:
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            return ProxyError(
                502, f"{leg} instance {base} is unreachable: {exc!r}", "upstream_unreachable"
            )
        if isinstance(exc, (httpx.TimeoutException, asyncio.TimeoutError)):
            return ProxyError(
                504, f"{leg} instance {base} did not answer within {limit_s:g}s", "upstream_timeout"
            )
        return ProxyError(502, f"{leg} instance {base} failed: {exc!r}", "upstream_error")

    async def post(
        self,
        leg: str,
        base: str,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        limit_s: float,
    ) -> httpx.Response:
        """POST and return the whole 200 response; the exchange is bounded by ``limit_s``."""
        try:
            resp = await asyncio.wait_for(
                self.client.post(
                    base + path,
                    content=json.dumps(body).encode(),
                    headers=headers,
                    timeout=self._timeout(limit_s),
                ),
                limit_s,
            )
        except (httpx.HTTPError, asyncio.TimeoutError) as exc:
            raise self._fail(leg, base, exc, limit_s) from exc
        if resp.status_code != 200:
            raise from_upstream(leg, resp.status_code, resp.content)
        return resp

    async def post_json(
        self,
        leg: str,
        base: str,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        limit_s: float,
    ) -> dict[str, Any]:
        resp = await self.post(leg, base, path, body, headers, limit_s)
        try:
            data = resp.json()
        except ValueError as exc:
            raise ProxyError(
                502, f"{leg} instance {base} sent invalid JSON", "upstream_error"
            ) from exc
        if not isinstance(data, dict):
            raise ProxyError(
                502, f"{leg} instance {base} sent a non-object JSON body", "upstream_error"
            )
        return data

    async def open_stream(
        self, leg: str, base: str, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> httpx.Response:
        """Open a streaming POST; headers within the decode timeout, chunks within idle timeout.

        The caller owns the returned response and must ``aclose()`` it.
        """
        req = self.client.build_request(
            "POST",
            base + path,
            content=json.dumps(body).encode(),
            headers=headers,
            timeout=self._timeout(self._t.idle_s),
        )
        try:
            resp = await asyncio.wait_for(self.client.send(req, stream=True), self._t.decode_s)
        except (httpx.HTTPError, asyncio.TimeoutError) as exc:
            raise self._fail(leg, base, exc, self._t.decode_s) from exc
        if resp.status_code != 200:
            try:
                content = await asyncio.wait_for(resp.aread(), self._t.idle_s)
            except (httpx.HTTPError, asyncio.TimeoutError):
                content = b""
            finally:
                await resp.aclose()
            raise from_upstream(leg, resp.status_code, content)
        return resp

    async def get_json(
        self, leg: str, base: str, path: str, headers: dict[str, str]
    ) -> httpx.Response:
        limit = self._t.connect_s * 2
        try:
            return await asyncio.wait_for(
                self.client.get(base + path, headers=headers, timeout=self._timeout(limit)), limit
            )
        except (httpx.HTTPError, asyncio.TimeoutError) as exc:
            raise self._fail(leg, base, exc, limit) from exc
