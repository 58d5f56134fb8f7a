"""Wait until backends answer /health: start-up ordering that also works across hosts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import httpx

from proxy.logsafe import get_logger

logger = get_logger("proxy.readiness")


async def wait_for_backends(
    urls: Sequence[str], timeout_s: float, poll_s: float = 2.0
) -> list[str]:
    """Poll each URL's /health until all answer 200; returns the ones still not ready."""
    deadline = time.monotonic() + timeout_s
    pending = list(dict.fromkeys(urls))
    async with httpx.AsyncClient(timeout=min(5.0, max(poll_s, 0.5))) as client:
        while pending:
            results = await asyncio.gather(
                *(client.get(u + "/health") for u in pending), return_exceptions=True
            )
            pending = [
                u
                for u, r in zip(pending, results, strict=True)
                if isinstance(r, BaseException) or r.status_code != 200
            ]
            if not pending:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            logger.info("waiting for %s (%.0fs left)", ", ".join(pending), left)
            await asyncio.sleep(min(poll_s, left))
    return pending
