"""``python -m proxy --prefill URL --decode URL --port N``"""

from __future__ import annotations

import logging

import uvicorn

from proxy.app import create_app
from proxy.settings import parse_args


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
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
