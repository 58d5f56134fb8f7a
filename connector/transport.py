"""The one place that talks to the Mooncake transfer engine.

The engine reports failure with negative return codes and never raises; this wrapper
turns those into :class:`TransferError` so callers cannot ignore them.

The engine's two ports (handshake and TCP data) serve reads and writes of the registered
KV cache to anyone who connects, and this engine version cannot bind them to the KV
address: they listen on every interface. At start-up the wrapper bounds how long a push
to a frozen peer may block (``MC_TRANSFER_TIMEOUT``), then checks from /proc where the
engine really listens and warns, naming the ports, when they need a firewall.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping, Sequence

from connector.engine_exposure import (
    Listener,
    effective_transfer_timeout_s,
    exposure_warning,
    listening_sockets_of,
    new_listeners,
    plan_env,
    port_range,
)
from connector.log import get_logger

logger = get_logger(__name__)


class TransferError(RuntimeError):
    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what} failed with code {code}")
        self.code = code


class MooncakeTransport:
    """One transfer engine per worker, in P2P-handshake mode (no metadata server)."""

    def __init__(
        self,
        host: str,
        protocol: str,
        device_name: str = "",
        transfer_timeout_s: float | None = None,
    ) -> None:
        """``transfer_timeout_s`` bounds one push to an unresponsive peer (engine: >= 5 s,
        whole seconds, default 30); an ``MC_TRANSFER_TIMEOUT`` the operator exported wins."""
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ImportError(
                "the Mooncake transfer engine is not installed: install the 'cpu' extra "
                "(mooncake-transfer-engine-non-cuda) or the 'gpu' extra "
                "(mooncake-transfer-engine); on Debian it also needs libibverbs1"
            ) from exc
        plan = plan_env(os.environ, transfer_timeout_s)
        before = _own_listeners()
        # The engine object reads MC_TRANSFER_TIMEOUT when it is constructed; the variable
        # is set only for that moment so it never leaks into another engine or a child.
        with _env(plan.apply):
            self._engine = TransferEngine()
            engine_env = {**os.environ}
        code = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if code != 0:
            raise TransferError(f"TransferEngine.initialize({host!r}, {protocol!r})", code)
        self.host = host
        self.protocol = protocol
        self.rpc_port = int(self._engine.get_rpc_port())
        self.transfer_timeout_s = effective_transfer_timeout_s(engine_env)
        self._registered: list[int] = []
        self._lock = threading.Lock()
        logger.info("mooncake engine up: session %s protocol %s", self.session, protocol)
        logger.info(
            "mooncake engine settings: %s; a push to an unresponsive peer fails after %d s",
            plan.describe(),
            self.transfer_timeout_s,
        )
        self.listeners = self._check_exposure(before, engine_env)

    def _check_exposure(self, before: list[Listener], environ: Mapping[str, str]) -> list[Listener]:
        """Find the engine's listening sockets and warn when they reach beyond the KV host."""
        lo, hi = port_range(environ)
        opened = new_listeners(before, _own_listeners())
        mine = [s for s in opened if lo <= s.port <= hi or s.port == self.rpc_port]
        if not mine:
            logger.warning(
                "could not find the mooncake engine's listening sockets in /proc; make sure "
                "TCP ports %d-%d are reachable only from the peer instances' KV addresses",
                lo,
                hi,
            )
            return mine
        where = ", ".join(f"{s.host}:{s.port}" for s in mine)
        warning = exposure_warning(mine, self.host, (lo, hi))
        if warning:
            logger.warning(warning)
        else:
            logger.info("mooncake engine listens only on the KV address: %s", where)
        return mine

    @property
    def session(self) -> str:
        """The id a peer uses to write into this engine's registered memory."""
        return f"{self.host}:{self.rpc_port}"

    def register(self, spans: Sequence[tuple[int, int]]) -> None:
        if not spans:
            return
        addrs = [a for a, _ in spans]
        code = self._engine.batch_register_memory(addrs, [n for _, n in spans])
        if code != 0:
            raise TransferError(f"batch_register_memory of {len(spans)} spans", code)
        with self._lock:
            self._registered.extend(addrs)

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """Synchronously push segments into ``session``'s registered memory."""
        code = self._engine.batch_transfer_sync_write(session, src, dst, lengths)
        if code != 0:
            raise TransferError(
                f"batch_transfer_sync_write of {len(src)} segments to {session}", code
            )

    def close(self) -> None:
        with self._lock:
            addrs, self._registered = self._registered, []
        if addrs:
            code = self._engine.batch_unregister_memory(addrs)
            if code != 0:
                logger.warning("batch_unregister_memory returned %d", code)


def _own_listeners() -> list[Listener]:
    return listening_sockets_of(os.getpid())


@contextlib.contextmanager
def _env(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block, then restore them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
