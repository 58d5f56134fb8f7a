"""Request bodies: a size limit, a time limit, and parsing that never stalls the event loop.

aiohttp gives the size limit (``client_max_size``); the declared length is checked first,
so an oversized body is refused before a byte of it is buffered. The whole body must
arrive within ``body_timeout_s`` (aiohttp has no body timeout): a client trickling its
body gets 408 and its connection closed. Parsing a large body is CPU work that holds the
GIL (``json.loads`` of 25 MB of token ids took 0.8 s here and stalled the loop just as
long in a thread), so bodies above ``offload_parse_bytes`` go to a worker process, which
also rewrites and re-serialises them and sends back only bytes and a few numbers.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from aiohttp import web

from proxy.errors import ProxyError
from proxy.rewrite import Plan, PlanOptions, plan_request
from proxy.settings import ClientLimits


class BodyReader:
    """Reads request bodies within the limits; tracks readers so shutdown can cut them."""

    def __init__(self, limits: ClientLimits, on_limit: Callable[[str], None]) -> None:
        self._limits = limits
        self._on_limit = on_limit
        self._reading: set[asyncio.Task[object]] = set()

    async def read(self, request: web.Request, max_bytes: int | None = None) -> bytes:
        limit = max_bytes or self._limits.max_body_bytes
        declared = request.content_length
        if declared is not None and declared > limit:
            raise self._too_large(limit)
        task = asyncio.current_task()
        assert task is not None
        self._reading.add(task)
        try:
            async with asyncio.timeout(self._limits.body_timeout_s):
                raw = await request.read()
        except TimeoutError:
            self._on_limit("body_timeout")
            raise ProxyError(
                408,
                f"request body not received within {self._limits.body_timeout_s:g}s",
                "body_timeout",
                hangup=True,
            ) from None
        except web.HTTPRequestEntityTooLarge:  # no (or a false) Content-Length
            raise self._too_large(limit) from None
        finally:
            self._reading.discard(task)
        if len(raw) > limit:
            raise self._too_large(limit)
        return raw

    def _too_large(self, limit: int) -> ProxyError:
        self._on_limit("body_size")
        return ProxyError(
            413, f"request body exceeds the limit of {limit} bytes", "body_too_large", close=True
        )

    def cancel_reads(self) -> int:
        """Shutdown: requests still sending their body are cut (they hold no upstream)."""
        for t in self._reading:
            t.cancel()
        return len(self._reading)


class BodyParser:
    """:func:`plan_request` inline for small bodies, in a worker process for big ones.

    The pool is created on first use (most proxies never see a big body) with the
    ``spawn`` start method (forking a process that runs an event loop and threads is
    unsafe). A cancelled request cancels its job if it has not started.
    """

    def __init__(self, limits: ClientLimits) -> None:
        self._limits = limits
        self._pool: ProcessPoolExecutor | None = None

    def offloads(self, size: int) -> bool:
        lim = self._limits
        return lim.parse_workers > 0 and 0 < lim.offload_parse_bytes < size

    async def plan(self, raw: bytes, endpoint: str, opts: PlanOptions) -> Plan:
        if not self.offloads(len(raw)):
            return plan_request(raw, endpoint, opts)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor(), plan_request, raw, endpoint, opts)
        except BrokenProcessPool as exc:  # a worker died (e.g. out of memory): start afresh
            self.close()
            raise ProxyError(
                503, "request parser worker failed; retry the request", "parser_unavailable"
            ) from exc

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=self._limits.parse_workers,
                mp_context=multiprocessing.get_context("spawn"),
            )
        return self._pool

    def warm(self) -> None:
        """Start the workers now, so the first big body does not wait for them."""
        if self._limits.parse_workers > 0:
            self._executor().submit(plan_request, b"{}", "completions", PlanOptions())

    def close(self) -> None:
        """Drop the pool at once (a broken one); its workers exit on their own."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def aclose(self) -> None:
        """Shutdown: queued jobs are cancelled, running ones (bounded by the body limit)
        finish, the workers exit; waited for in a thread, off the event loop."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)
