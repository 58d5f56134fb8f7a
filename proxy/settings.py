"""The proxy's settings: one typed object, built from the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 5.0
    # The whole prefill leg; long prompts on slow prefillers need minutes.
    prefill_s: float = 300.0
    # Decode leg: until the response headers (non-streaming: the whole answer).
    decode_s: float = 600.0
    # Streaming: longest silence between two chunks from the decoder.
    idle_s: float = 120.0


@dataclass(frozen=True)
class ProxySettings:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    timeouts: Timeouts = field(default_factory=Timeouts)
    max_connections: int = 1024
    log_level: str = "info"
    # Before listening, wait up to this long for every instance's /health (0: don't wait).
    wait_backends_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("at least one --prefill and one --decode URL are required")
        for url in (*self.prefill, *self.decode):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"instance URL must start with http:// or https://: {url!r}")


def parse_args(argv: list[str] | None = None) -> ProxySettings:
    ap = argparse.ArgumentParser(
        prog="python -m proxy",
        description="OpenAI-compatible proxy for disaggregated prefill/decode vLLM instances.",
    )
    ap.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="base URL of a prefill vLLM instance (repeatable)",
    )
    ap.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="base URL of a decode vLLM instance (repeatable)",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--connect-timeout", type=float, default=Timeouts.connect_s)
    ap.add_argument("--prefill-timeout", type=float, default=Timeouts.prefill_s)
    ap.add_argument("--decode-timeout", type=float, default=Timeouts.decode_s)
    ap.add_argument("--idle-timeout", type=float, default=Timeouts.idle_s)
    ap.add_argument(
        "--max-connections", type=int, default=1024, help="upstream connection pool size per proxy"
    )
    ap.add_argument("--log-level", default="info")
    ap.add_argument(
        "--wait-backends",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before listening, wait until every instance answers /health; exit 1 if not",
    )
    a = ap.parse_args(argv)
    try:
        return ProxySettings(
            prefill=tuple(u.rstrip("/") for u in a.prefill),
            decode=tuple(u.rstrip("/") for u in a.decode),
            host=a.host,
            port=a.port,
            timeouts=Timeouts(
                a.connect_timeout, a.prefill_timeout, a.decode_timeout, a.idle_timeout
            ),
            max_connections=a.max_connections,
            log_level=a.log_level,
            wait_backends_s=a.wait_backends,
        )
    except ValueError as exc:
        ap.error(str(exc))
        raise  # unreachable: ap.error exits
