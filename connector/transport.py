"""The one place that talks to the Mooncake transfer engine.

The engine reports failure with negative return codes and never raises; this wrapper
turns those into :class:`TransferError` so callers cannot ignore them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from connector.log import get_logger

logger = get_logger(__name__)


class TransferError(RuntimeError):
    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what} failed with code {code}")
        self.code = code


class MooncakeTransport:
    """One transfer engine per worker, in P2P-handshake mode (no metadata server)."""

    def __init__(self, host: str, protocol: str, device_name: str = "") -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ImportError(
                "the Mooncake transfer engine is not installed: install the 'cpu' extra "
                "(mooncake-transfer-engine-non-cuda) or the 'gpu' extra "
                "(mooncake-transfer-engine); on Debian it also needs libibverbs1"
            ) from exc
        self._engine = TransferEngine()
        code = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if code != 0:
            raise TransferError(f"TransferEngine.initialize({host!r}, {protocol!r})", code)
        self.host = host
        self.protocol = protocol
        self.rpc_port = int(self._engine.get_rpc_port())
        self._registered: list[int] = []
        self._lock = threading.Lock()
        logger.info("mooncake engine up: session %s protocol %s", self.session, protocol)

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
