"""Worker-side lifecycle: the engine, memory registration, the threads, and results.

A prefiller worker serves pulls on its side channel; a decoder worker issues pulls.
An instance with ``kv_both`` does both. Everything started here is stopped by
:meth:`P2pWorker.shutdown`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from connector.layout import KVMemory, describe_kv_caches
from connector.log import get_logger
from connector.receiver import PullClient, PullSpec
from connector.scheduler import P2pMetadata
from connector.send_registry import Outcome, SendRegistry
from connector.sender import PushHandler, SideChannelServer
from connector.settings import ConnectorSettings
from connector.transport import MooncakeTransport

logger = get_logger(__name__)


class P2pWorker:
    def __init__(
        self,
        settings: ConnectorSettings,
        engine_id: str,
        num_blocks: int,
        tp_rank: int,
        side_channel_port: int,
        can_produce: bool,
        can_consume: bool,
    ) -> None:
        self._settings = settings
        self._engine_id = engine_id
        self._num_blocks = num_blocks
        self._tp_rank = tp_rank
        self._side_channel_port = side_channel_port
        self._can_produce = can_produce
        self._can_consume = can_consume
        self._host = settings.advertised_host()
        self.transport = MooncakeTransport(self._host, settings.protocol, settings.device_name)
        self.memory: KVMemory | None = None
        self.registry = SendRegistry(settings.expiry_s)
        self._server: SideChannelServer | None = None
        self._handler: PushHandler | None = None
        self._client: PullClient | None = None

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.memory = describe_kv_caches(kv_caches, self._num_blocks)
        layout = self.memory.layout
        self.transport.register(self.memory.spans)
        logger.info(
            "registered %d KV regions of %d layers (%d blocks of %d B, stride %d B) as %d spans",
            len(layout.base_addrs),
            self.memory.num_layers,
            layout.num_blocks,
            layout.block_len,
            layout.block_stride,
            len(self.memory.spans),
        )
        if self._can_produce:
            self._handler = PushHandler(
                self.registry,
                layout,
                self.transport.write,
                self._settings.ready_timeout_s,
                self._settings.max_segments_per_batch,
            )
            self._server = SideChannelServer(
                self._settings.side_channel_bind_host(),
                self._side_channel_port,
                self._handler,
                self._settings.sender_threads,
            )
            self._server.start()
        if self._can_consume:
            self._client = PullClient(
                self._engine_id, self.transport.session, layout, self._settings.pull_timeout_s
            )
            self._client.start()

    def start_load_kv(self, meta: P2pMetadata) -> None:
        for tid, block_ids in meta.send.items():
            self.registry.add(tid, block_ids)
        for tid in meta.dropped:
            self.registry.mark_aborted(tid)
        if meta.recv:
            if self._client is None:
                raise RuntimeError("this instance is not a KV consumer but was asked to pull KV")
            self._client.submit(
                [
                    PullSpec(
                        t.request_id,
                        t.transfer_id,
                        t.block_ids,
                        f"tcp://{t.remote_host}:{t.remote_port + self._tp_rank}",
                    )
                    for t in meta.recv
                ]
            )

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving)."""
        expired = self.registry.expire()
        if expired:
            logger.warning(
                "freed %d held requests that no decoder asked for within %gs (total %d): %s",
                len(expired),
                self._settings.expiry_s,
                self.registry.counts[Outcome.EXPIRED],
                ", ".join(expired[:8]),
            )
        sending = self.registry.take_finished()
        recving: set[str] = set()
        failed: set[str] = set()
        if self._client is not None:
            recving, failed = self._client.take_results()
        return sending, recving, failed

    def has_held_requests(self) -> bool:
        return self.registry.num_held() > 0

    def shutdown(self) -> None:
        self.registry.close()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._client is not None:
            self._client.close()
            self._client = None
        self.transport.close()
