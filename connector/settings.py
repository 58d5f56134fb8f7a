"""Connector settings from ``kv_connector_extra_config`` and the environment, in one place.

Precedence: the extra config, then the ``PD_KV_*`` environment variable, then the default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from connector.log import get_logger

logger = get_logger(__name__)

ENV_PREFIX = "PD_KV_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class ConnectorSettings:
    # Mooncake transport: "rdma" on real clusters, "tcp" on machines without RDMA.
    protocol: str = "rdma"
    # RDMA device names (e.g. "mlx5_0,mlx5_1"); empty lets the engine pick.
    device_name: str = ""
    # Address peers use to reach this worker (side channel and transfer engine).
    # Empty: vLLM's notion of this host's IP (VLLM_HOST_IP or the default route's).
    host: str = ""
    # Address the prefiller's side channel binds to; empty: same as ``host``.
    bind_host: str = ""
    # Prefiller side channel: base port + dp_rank * tp_size + tp_rank.
    side_channel_port: int = 17100
    # Decoder: how long one pull may take end to end (wait, push, reply).
    pull_timeout_s: float = 30.0
    # Prefiller: how long a pull may wait (parked, no thread held) for its request's
    # blocks to be handed over.
    ready_timeout_s: float = 10.0
    # Prefiller: blocks that no decoder asked for within this time are freed.
    expiry_s: float = 120.0
    # Segments per batch_transfer_sync_write, under the engine's per-peer queue cap (1024).
    max_segments_per_batch: int = 1000
    # Bytes per batch_transfer_sync_write: bounds how long one engine call may run.
    max_batch_bytes: int = 256 << 20
    # Mooncake's own per-transfer timeout (MC_TRANSFER_TIMEOUT, engine minimum 5 s): bounds a
    # push to a frozen decoder. The decoder keeps this much (+1 s) of its pull timeout in
    # reserve, so no batch can still be running when it gives up.
    transfer_timeout_s: float = 5.0
    # Prefiller threads that serve pulls. Few: concurrent senders slow each other down.
    sender_threads: int = 2
    # Prefiller: requests per pull message (the decoder splits bigger steps).
    max_items_per_pull: int = 256
    # Prefiller: pulls parked waiting for their blocks, and pushes queued, at most.
    max_parked: int = 1024
    max_queued_pushes: int = 1024
    # Both sides: largest side-channel frame accepted (ZMQ_MAXMSGSIZE); bigger: disconnect.
    max_message_bytes: int = 16 << 20
    # Decoder: close the socket to a prefiller idle this long (nothing pending).
    peer_idle_s: float = 60.0
    # Decoder: after a pull times out, wait this long before vLLM may reuse its blocks, so
    # bytes a frozen or partitioned path still had in flight land first.
    late_write_grace_s: float = 1.0
    # Prefiller: after the engine failed a push (e.g. the decoder's ports were cut off), keep
    # that request's blocks this long before vLLM may reuse them. Mooncake's TCP transport
    # may still deliver the failed write once the path heals, reading our blocks then: held,
    # they still hold this request's KV, not another's (seen in the chaos soak).
    failed_push_hold_s: float = 30.0
    # Decoder: ask for a keyed digest of the pushed bytes and check it before reporting the
    # load done (costs a hash of the blocks on both sides).
    verify_digest: bool = False
    # Compatibility fingerprint's model id; empty: vLLM's served model name.
    model_id: str = ""
    # vLLM steps an engine back to back while a transfer is outstanding, even with nothing to
    # run (a held request, or a request waiting for its KV): a hot spin. Such an empty step
    # is delayed by this much in the scheduler. 0 turns pacing off; a new request arriving
    # then may be scheduled up to this much later.
    idle_wait_ms: float = 5.0

    @classmethod
    def load(
        cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
    ) -> ConnectorSettings:
        extra = dict(extra or {})
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw: Any = extra.pop(f.name, None)
            from_env = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None and from_env is not None and str(from_env) != str(raw):
                # A silently ignored variable looks like a setting that does not work.
                logger.warning(
                    "%s%s=%s is ignored: the kv-transfer config sets %s=%r",
                    ENV_PREFIX,
                    f.name.upper(),
                    from_env,
                    f.name,
                    raw,
                )
            if raw is None:
                raw = from_env
            if raw is None:
                continue
            try:
                values[f.name] = _convert(raw, f.default)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"connector setting {f.name}={raw!r}: {exc}") from exc
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        for name in (
            "pull_timeout_s",
            "ready_timeout_s",
            "expiry_s",
            "transfer_timeout_s",
            "peer_idle_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"connector setting {name} must be positive")
        if not 0 < self.side_channel_port < 65536:
            raise ValueError("connector setting side_channel_port must be a TCP port")
        if not 1 <= self.max_segments_per_batch <= 1024:
            raise ValueError("connector setting max_segments_per_batch must be in 1..1024")
        if not 1 <= self.max_items_per_pull <= 1024:
            raise ValueError("connector setting max_items_per_pull must be in 1..1024")
        for name in ("max_parked", "max_queued_pushes", "sender_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"connector setting {name} must be at least 1")
        if self.max_message_bytes < 64 << 10:
            raise ValueError("connector setting max_message_bytes must be at least 64 KiB")
        if self.max_batch_bytes < 1 << 20:
            raise ValueError("connector setting max_batch_bytes must be at least 1 MiB")
        if self.idle_wait_ms < 0 or self.late_write_grace_s < 0 or self.failed_push_hold_s < 0:
            raise ValueError(
                "connector settings idle_wait_ms, late_write_grace_s, failed_push_hold_s: "
                "not negative"
            )
        if not self.protocol:
            raise ValueError("connector setting protocol must not be empty")

    def advertised_host(self) -> str:
        if self.host:
            return self.host
        from vllm.utils.network_utils import get_ip

        return get_ip()

    def engine_base_port(self, dp_rank: int, tp_size: int) -> int:
        """The side-channel port of TP rank 0 of DP engine ``dp_rank``: each DP engine's
        ranks get their own range, and the engine advertises this base in the params it
        returns, so decoders and the proxy address the ranks that hold the request."""
        port = self.side_channel_port + dp_rank * tp_size
        if port + tp_size > 65536:
            raise ValueError(
                f"side_channel_port {self.side_channel_port} leaves no room for DP rank "
                f"{dp_rank} x TP {tp_size} ports"
            )
        return port

    def pull_budget_s(self) -> float:
        """How long after sending a pull the prefiller may still start a push batch.

        The rest of the pull timeout is kept in reserve: one batch may run for up to the
        engine's transfer timeout after the budget ends, and must be over before the decoder
        gives up and vLLM reuses the blocks. A pull timeout too short for that reserve
        (tests) falls back to a fifth of it, and the worker warns.
        """
        reserve = self.transfer_timeout_s + 1.0
        if self.pull_timeout_s >= reserve + 1.0:
            return self.pull_timeout_s - reserve
        return max(0.5, 0.8 * self.pull_timeout_s)

    def side_channel_bind_host(self) -> str:
        return self.bind_host or self.advertised_host()


def _convert(raw: Any, default: Any) -> Any:
    if isinstance(default, bool):
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError("expected a boolean (true/false)")
    if isinstance(default, float) and isinstance(raw, bool):
        raise TypeError("expected a number")
    return type(default)(raw)
