"""Scheduler-side state: what to receive, what to hold for a decoder, what to release.

Runs in vLLM's scheduler process and never touches sockets; each engine step it hands
the worker a :class:`P2pMetadata` with the work it decided on.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.request import RequestStatus

from connector.groups import GroupSpec
from connector.log import get_logger
from connector.logsafe import redacted, safe

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = get_logger(__name__)


@dataclass(frozen=True)
class RecvTask:
    request_id: str
    transfer_id: str
    secret: str
    # Per transfer group, decoder block slots to fill (positional, 0 = nothing to fill).
    # All empty means "release your blocks, I need nothing".
    block_ids: list[list[int]]
    remote_host: str
    remote_port: int  # the prefiller engine's base port; rank r listens on port + r
    remote_tp_size: int = 1


@dataclass(frozen=True)
class SendTask:
    # Per transfer group, the prefiller's block slots (positional, 0 = out of window).
    block_ids: list[list[int]]
    secret: str


@dataclass
class P2pMetadata(KVConnectorMetadata):
    recv: list[RecvTask] = field(default_factory=list)
    # transfer id -> blocks held for a decoder
    send: dict[str, SendTask] = field(default_factory=dict)
    # transfer ids the prefiller finished without holding blocks (aborted, stopped early)
    dropped: list[str] = field(default_factory=list)
    # transfer ids of do_remote_decode requests just admitted: a pull for one of them may
    # wait (parked) for the hand-over; a pull for any other unknown id is refused at once
    expected: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RemotePrefill:
    """Validated ``kv_transfer_params`` of a request whose prompt KV lives on a prefiller."""

    transfer_id: str
    secret: str
    remote_host: str
    remote_port: int
    remote_tp_size: int = 1

    @classmethod
    def parse(cls, params: object) -> RemotePrefill | None:
        """None unless every field is present with the right type and range."""
        if not isinstance(params, dict):
            return None
        tid, host, port = (
            params.get("transfer_id"),
            params.get("remote_host"),
            params.get("remote_port"),
        )
        secret = params.get("transfer_secret")
        for value in (tid, host, secret):
            if not (isinstance(value, str) and 0 < len(value) <= 256):
                return None
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            return None
        tp = params.get("remote_tp_size", 1)
        if isinstance(tp, bool) or not isinstance(tp, int) or not 0 < tp <= 1024:
            return None
        if port + tp > 65536:
            return None
        return cls(tid, secret, host, port, tp)


def transfer_params(request: Request) -> dict[str, Any] | None:
    """The request's kv_transfer_params if they are a dict, else None (and never raise).

    vLLM copies them from client-controlled fields (top level or ``vllm_xargs``) without
    checking their type: a string or a list must not reach ``.get`` inside the scheduler.
    """
    params = request.kv_transfer_params
    if params is None or isinstance(params, dict):
        return params
    return None


def flag(params: dict[str, Any] | None, key: str) -> bool:
    """A boolean field that counts only when it is literally ``true``."""
    return bool(params) and params.get(key) is True


class P2pScheduler:
    def __init__(
        self,
        engine_id: str,
        host: str,
        side_channel_port: int,
        can_produce: bool,
        can_consume: bool,
        groups: tuple[GroupSpec, ...],
        transfer_group_ids: tuple[int, ...],
        idle_wait_s: float = 0.0,
        tp_size: int = 1,
    ) -> None:
        self.engine_id = engine_id
        self._tp_size = tp_size
        # Requests whose kv_transfer_params were not a well-formed dict: served locally.
        self.num_bad_params = 0
        self._announced: set[str] = set()
        self._idle_wait_s = idle_wait_s
        # Requests with a transfer outstanding: held for a decoder, or waiting for their KV.
        self._outstanding: set[str] = set()
        self._groups = groups
        self._transfer_group_ids = transfer_group_ids
        self._host = host
        self._port = side_channel_port
        self._can_produce = can_produce
        self._can_consume = can_consume
        self._meta = P2pMetadata()
        self.num_not_handed_over = 0  # do_remote_decode requests that ended without KV to hand over

    # --- decode side -----------------------------------------------------------------------

    def _bad_params(self, request: Request, why: str) -> None:
        self.num_bad_params += 1
        logger.warning(
            "request %s: %s kv_transfer_params %s ignored; serving it without a transfer",
            safe(request.request_id),
            why,
            redacted(request.kv_transfer_params),
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = transfer_params(request)
        if params is None and request.kv_transfer_params is not None:
            if request.request_id not in self._announced:
                self._announced.add(request.request_id)  # warn once per request
                self._bad_params(request, "malformed")
            return 0, False
        rid = request.request_id
        if self._can_produce and flag(params, "do_remote_decode") and rid not in self._announced:
            self._announced.add(rid)
            self._meta.expected.append(rid)
        if not (self._can_consume and flag(params, "do_remote_prefill")):
            return 0, False
        if RemotePrefill.parse(params) is None:
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = transfer_params(request)
        if not (self._can_consume and params is not None and flag(params, "do_remote_prefill")):
            return
        # One transfer per request, even if it is preempted and scheduled again.
        params["do_remote_prefill"] = False
        remote = RemotePrefill.parse(params)
        if remote is None:
            self._bad_params(request, "incomplete")
            return
        block_ids: list[list[int]] = [[] for _ in self._groups]
        if num_external_tokens > 0:
            every_group = blocks.get_block_ids()
            n_prompt = request.num_prompt_tokens
            n_local = n_prompt - num_external_tokens  # a local prefix hit, block aligned
            for i, (gid, spec) in enumerate(
                zip(self._transfer_group_ids, self._groups, strict=True)
            ):
                # Positional slots after the local prefix; sliding-window groups keep their
                # null (0) slots so both sides stay aligned.
                first, end = n_local // spec.block_size, -(-n_prompt // spec.block_size)
                block_ids[i] = list(every_group[gid][first:end])
        self._add_recv(request.request_id, remote, block_ids)

    def _add_recv(self, request_id: str, remote: RemotePrefill, block_ids: list[list[int]]) -> None:
        if any(block_ids):
            self._outstanding.add(request_id)
        self._meta.recv.append(
            RecvTask(
                request_id,
                remote.transfer_id,
                remote.secret,
                block_ids,
                remote.remote_host,
                remote.remote_port,
                remote.remote_tp_size,
            )
        )

    # --- both sides ------------------------------------------------------------------------

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: per KV cache group (all groups, vLLM's order), positional."""
        self._announced.discard(request.request_id)
        params = transfer_params(request)
        if not params:
            return False, None
        if flag(params, "do_remote_prefill"):
            # Never allocated (aborted while waiting): still tell the prefiller to free.
            params["do_remote_prefill"] = False
            remote = RemotePrefill.parse(params)
            if remote is not None:
                self._add_recv(request.request_id, remote, [[] for _ in self._groups])
            return False, None
        if not (self._can_produce and flag(params, "do_remote_decode")):
            return False, None
        held = [list(block_ids[gid]) for gid in self._transfer_group_ids]
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED or not any(any(g) for g in held):
            # EOS, a stop string or an abort: the proxy gets no params and the decoder
            # computes the prompt itself.
            self.num_not_handed_over += 1
            self._meta.dropped.append(request.request_id)
            logger.warning(
                "request %s finished as %s: KV not handed over",
                safe(request.request_id),
                request.status.name,
            )
            return False, None
        secret = secrets.token_urlsafe(24)
        self._meta.send[request.request_id] = SendTask(held, secret)
        self._outstanding.add(request.request_id)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self._host,
            "remote_port": self._port,
            # The decoder and a router's release address every rank: port + tp_rank.
            "remote_tp_size": self._tp_size,
            "transfer_id": request.request_id,
            "transfer_secret": secret,
            "remote_num_blocks": [sum(1 for b in g if b) for g in held],
        }

    def build_connector_meta(self, idle_step: bool = False) -> P2pMetadata:
        meta, self._meta = self._meta, P2pMetadata()
        empty = idle_step and not meta.recv and not meta.send and not meta.expected
        if empty and self._outstanding and self._idle_wait_s > 0:
            # vLLM steps an engine back to back while a transfer is outstanding, even with
            # nothing to run; its engine core and worker then busy-poll each other (measured:
            # 175% CPU on 2 cores for one held request). A short sleep here, in the engine
            # core, paces those empty steps; a new request waits at most this long.
            time.sleep(self._idle_wait_s)
        return meta

    def update_connector_output(
        self, finished_sending: set[str], finished_recving: set[str]
    ) -> None:
        self._outstanding -= finished_sending
        self._outstanding -= finished_recving
