"""Connector settings from ``kv_connector_extra_config`` and the environment, in one place.

Precedence: the extra config, then the ``PD_KV_*`` environment variable, then the default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

ENV_PREFIX = "PD_KV_"


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
    # Prefiller: how long a pull waits for its request's blocks to be handed over.
    ready_timeout_s: float = 10.0
    # Prefiller: blocks that no decoder asked for within this time are freed.
    expiry_s: float = 120.0
    # Segments per batch_transfer_sync_write, under the engine's per-peer queue cap (1024).
    max_segments_per_batch: int = 1000
    # Prefiller threads that serve pulls. Few: concurrent senders slow each other down.
    sender_threads: int = 2
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
            if raw is None:
                raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            default = f.default
            try:
                values[f.name] = type(default)(raw)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"connector setting {f.name}={raw!r}: {exc}") from exc
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        for name in ("pull_timeout_s", "ready_timeout_s", "expiry_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"connector setting {name} must be positive")
        if not 0 < self.side_channel_port < 65536:
            raise ValueError("connector setting side_channel_port must be a TCP port")
        if not 1 <= self.max_segments_per_batch <= 1024:
            raise ValueError("connector setting max_segments_per_batch must be in 1..1024")
        if self.idle_wait_ms < 0:
            raise ValueError("connector setting idle_wait_ms must not be negative")
        if self.sender_threads < 1:
            raise ValueError("connector setting sender_threads must be at least 1")
        if not self.protocol:
            raise ValueError("connector setting protocol must not be empty")

    def advertised_host(self) -> str:
        if self.host:
            return self.host
        from vllm.utils.network_utils import get_ip

        return get_ip()

    def side_channel_bind_host(self) -> str:
        return self.bind_host or self.advertised_host()
