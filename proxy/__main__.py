"""``python -m proxy --prefill URL --decode URL --port N`` (or ``--config configs/proxy.yaml``)"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from proxy.app import Proxy
from proxy.readiness import wait_for_backends
from proxy.settings import ProxySettings, parse_args


async def serve(settings: ProxySettings) -> None:
    proxy = Proxy(settings)
    await proxy.start(settings.host, settings.port)
    proxy.parser.warm()  # the big-body worker starts now, not on the first big body
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        logging.getLogger("proxy").info("signal received: graceful shutdown")
    finally:
        await proxy.stop()


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if settings.wait_backends_s > 0:
        missing = asyncio.run(
            wait_for_backends(
                (*settings.prefill_urls, *settings.decode_urls), settings.wait_backends_s
            )
        )
        if missing:
            logging.error("not ready after %gs: %s", settings.wait_backends_s, ", ".join(missing))
            sys.exit(1)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio works too
        asyncio.run(serve(settings))
    else:
        uvloop.run(serve(settings))


if __name__ == "__main__":
    main()
