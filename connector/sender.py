"""Prefiller side: accept pulls on a ZMQ ROUTER, push blocks, reply per request.

The socket thread only decodes and routes; pushes run on a small thread pool, and
their replies come back to the socket thread through an inproc pipe (ZMQ sockets are
not thread-safe). A malformed pull is answered with an error and never stops the loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import zmq

from connector.groups import pair_blocks
from connector.layout import GroupLayout, layout_mismatch
from connector.log import get_logger
from connector.plan import RegionLayout, TransferPlan, build_transfer_plan
from connector.recorder import TransferRecorder
from connector.send_registry import ClaimError, Outcome, SendRegistry
from connector.transport import TransferError
from connector.wire import GroupGeometry, PullReply, PullRequest, WireError, decode_pull, encode

logger = get_logger(__name__)

WriteFn = Callable[[str, list[int], list[int], list[int]], None]


def plan_item(
    local_ids: list[list[int]],
    remote_ids: list[list[int]],
    local: tuple[GroupLayout, ...],
    remote: list[GroupGeometry],
) -> tuple[TransferPlan, int]:
    """One request's segments over all groups, each within its own group's layers."""
    if len(local_ids) != len(local) or len(remote_ids) != len(local):
        raise ValueError(
            f"block ids for {len(remote_ids)} groups from the decoder, {len(local_ids)} held, "
            f"{len(local)} expected"
        )
    plans, blocks = [], 0
    for g, (mine, theirs) in enumerate(zip(local_ids, remote_ids, strict=True)):
        src, dst = pair_blocks(mine, theirs)
        r = remote[g]
        dst_layout = RegionLayout(tuple(r.region_bases), r.block_len, r.block_stride, r.num_blocks)
        plans.append(build_transfer_plan(src, dst, local[g].layout, dst_layout))
        blocks += len(src)
    return TransferPlan.concat(plans), blocks


class PushHandler:
    """Serve one decoded pull: claim, check, plan, push, finish. No sockets here."""

    def __init__(
        self,
        registry: SendRegistry,
        groups: tuple[GroupLayout, ...],
        write: WriteFn,
        ready_timeout_s: float,
        max_segments_per_batch: int,
        recorder: TransferRecorder,
    ) -> None:
        self._registry = registry
        self._groups = groups
        self._write = write
        self._ready_timeout_s = ready_timeout_s
        self._max_segments = max_segments_per_batch
        self._rec = recorder

    def _refuse(self, req: PullRequest, tid: str, error: str) -> PullReply:
        self._rec.event("refused")
        logger.warning("pull %s from %s refused: %s", tid, req.decoder_engine_id, error)
        return PullReply(req.msg_id, tid, ok=False, error=error)

    def serve(self, req: PullRequest) -> Iterator[PullReply]:
        # Wall clock: the deadline is the decoder's; hosts are expected to run NTP.
        deadline = req.deadline_ms / 1000.0
        mismatch = layout_mismatch(self._groups, req.groups)
        for item in req.items:
            tid = item.transfer_id
            late_s = time.time() - deadline
            try:
                wait = min(self._ready_timeout_s, max(0.0, -late_s))
                local_ids = self._registry.claim(tid, wait, item.secret)
            except ClaimError as exc:
                yield self._refuse(req, tid, str(exc))
                continue
            # From here the caller proved it holds this request's secret: any refusal ends
            # the request (frees its blocks), since its decoder will not ask again.
            if late_s > 0:
                self._registry.finish(tid, Outcome.FAILED)
                yield self._refuse(
                    req,
                    tid,
                    f"pull for {tid} arrived {late_s:.3f}s after the decoder's deadline "
                    "(a delayed message, or clocks out of sync)",
                )
                continue
            if item.is_release:
                self._registry.finish(tid, Outcome.RELEASED)
                logger.debug("transfer %s released by decoder (nothing to send)", tid)
                yield PullReply(req.msg_id, tid, ok=True)
                continue
            if mismatch:
                self._registry.finish(tid, Outcome.FAILED)
                yield self._refuse(req, tid, mismatch)
                continue
            yield self._push(req, tid, local_ids, item.block_ids, deadline)

    def _push(
        self,
        req: PullRequest,
        tid: str,
        local_ids: list[list[int]],
        remote_ids: list[list[int]],
        deadline: float,
    ) -> PullReply:
        t0 = time.perf_counter()
        try:
            plan, n_blocks = plan_item(local_ids, remote_ids, self._groups, req.groups)
            for src, dst, lengths in plan.batches(self._max_segments):
                if time.time() > deadline:
                    raise TimeoutError("the decoder's deadline passed before the push finished")
                self._write(req.decoder_session, src, dst, lengths)
        except Exception as exc:
            # Whatever went wrong, a claimed request must end here or its blocks are stranded
            # (expiry skips claimed requests).
            self._registry.finish(tid, Outcome.FAILED)
            self._rec.event("push_failures")
            expected = isinstance(exc, (ValueError, TransferError, TimeoutError))
            logger.error(
                "transfer %s to %s failed: %s",
                tid,
                req.decoder_session,
                exc,
                exc_info=not expected,
            )
            return PullReply(req.msg_id, tid, ok=False, error=str(exc))
        elapsed = time.perf_counter() - t0
        self._registry.finish(tid, Outcome.SENT)
        self._rec.push(elapsed, plan.total_bytes, n_blocks, len(plan))
        logger.info(
            "transfer %s: pushed %d blocks as %d segments, %d bytes in %.2f ms to %s",
            tid,
            n_blocks,
            len(plan),
            plan.total_bytes,
            elapsed * 1e3,
            req.decoder_session,
        )
        return PullReply(
            req.msg_id, tid, ok=True, num_bytes=plan.total_bytes, num_segments=len(plan)
        )


class SideChannelServer:
    """The ROUTER socket thread plus the sender pool. Owns every socket and thread it makes."""

    def __init__(self, bind_host: str, port: int, handler: PushHandler, threads: int) -> None:
        self._handler = handler
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.endpoint = f"tcp://{bind_host}:{port}"
        self._router.bind(self.endpoint)
        self._inbox = f"inproc://pd-kv-replies-{id(self)}"
        self._replies_in = self._ctx.socket(zmq.PULL)
        self._replies_in.bind(self._inbox)
        self._replies_out = self._ctx.socket(zmq.PUSH)
        self._replies_out.setsockopt(zmq.LINGER, 0)
        self._replies_out.connect(self._inbox)
        self._out_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="pd-kv-send")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pd-kv-side-channel", daemon=True)
        self.malformed = 0

    def start(self) -> None:
        self._thread.start()
        logger.info("KV side channel listening on %s", self.endpoint)

    def _reply(self, ident: bytes, reply: PullReply) -> None:
        with self._out_lock:
            if not self._stop.is_set():
                self._replies_out.send_multipart([ident, encode(reply)])

    def _serve(self, ident: bytes, req: PullRequest) -> None:
        try:
            for reply in self._handler.serve(req):
                self._reply(ident, reply)
        except Exception as exc:  # never let one pull kill the pool thread silently
            logger.exception("pull %d failed unexpectedly", req.msg_id)
            self._reply(ident, PullReply(req.msg_id, "", ok=False, error=f"internal error: {exc}"))

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._replies_in, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(100))
            except zmq.ZMQError:
                break
            if self._replies_in in events:
                while True:
                    try:
                        frames = self._replies_in.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._router.send_multipart(frames)
            if self._router in events:
                frames = self._router.recv_multipart()
                self._on_message(frames)

    def _on_message(self, frames: list[bytes]) -> None:
        ident, payload = frames[0], frames[-1]
        try:
            if len(frames) < 2:
                raise WireError("empty message")
            req = decode_pull(payload)
        except WireError as exc:
            self.malformed += 1
            logger.warning("malformed pull (%d bytes): %s", len(payload), exc)
            self._router.send_multipart(
                [ident, encode(PullReply(-1, "", ok=False, error=str(exc)))]
            )
            return
        try:
            self._pool.submit(self._serve, ident, req)
        except RuntimeError:  # pool already shut down
            return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=True, cancel_futures=True)
        for sock in (self._router, self._replies_in, self._replies_out):
            sock.close(linger=0)
        self._ctx.term()
