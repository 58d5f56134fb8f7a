"""Run the proxy (aiohttp on its own event loop) in a background thread for tests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from proxy.app import Proxy
from proxy.settings import ProxySettings
from tests.servers import free_port


@dataclass
class Running:
    url: str
    proxy: Proxy
    loop: asyncio.AbstractEventLoop

    def call(self, fn, *args, timeout: float = 10):
        """Run ``fn(*args)`` on the proxy's loop (its state is not thread-safe)."""

        async def run():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def stop(self, grace_s: float) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.stop(grace_s), self.loop).result(grace_s + 15)


@contextmanager
def serve_proxy(settings: ProxySettings) -> Iterator[Running]:
    loop = asyncio.new_event_loop()
    proxy = Proxy(settings)
    port = free_port()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(proxy.start("127.0.0.1", port), loop).result(10)
    running = Running(f"http://127.0.0.1:{port}", proxy, loop)
    try:
        yield running
    finally:
        asyncio.run_coroutine_threadsafe(proxy.stop(0.5), loop).result(20)

        async def drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(drain(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
