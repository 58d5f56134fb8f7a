"""``python -m proxy --prefill URL --decode URL --port N``"""

from __future__ import annotations

import asyncio
import logging
import sys

import uvicorn

from proxy.app import create_app
from proxy.readiness import wait_for_backends
from proxy.settings import parse_args


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if settings.wait_backends_s > 0:
        missing = asyncio.run(
            wait_for_backends((*settings.prefill, *settings.decode), settings.wait_backends_s)
        )
        if missing:
            logging.error("not ready after %gs: %s", settings.wait_backends_s, ", ".join(missing))
            sys.exit(1)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=30,
    )


if __name__ == "__main__":
    main()
