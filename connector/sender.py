"""Prefiller side: accept pulls on a ZMQ ROUTER, push blocks, reply per request.

Nothing here waits while holding a thread: the socket thread decodes, claims or parks
each item (a parked pull is a callback, woken when its blocks are handed over or timed
out by the socket loop), and queues pushes per decoder. Each decoder has at most one
push running (a frozen decoder holds one sender thread, for at most the engine's
transfer timeout per batch); queues and parking are capped, and what does not fit is
refused at once. Replies come back to the socket thread through an inproc pipe (ZMQ
sockets are not thread-safe). A malformed pull is answered with an error and never
stops the loop.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

import zmq

from connector.digest import MemoryReader, keyed_digest
from connector.groups import pair_blocks
from connector.layout import GroupLayout, layout_mismatch
from connector.log import get_logger
from connector.logsafe import safe
from connector.plan import RegionLayout, TransferPlan, build_transfer_plan
from connector.recorder import TransferRecorder
from connector.send_registry import ClaimError, Outcome, SendRegistry
from connector.tp import Slice, byte_slice, cover, rank_heads
from connector.transport import TransferError
from connector.wire import (
    ENGINE_FAILED,
    Compat,
    GroupGeometry,
    PullItem,
    PullReply,
    PullRequest,
    WireError,
    decode_pull,
    encode,
)

logger = get_logger(__name__)

WriteFn = Callable[[str, list[int], list[int], list[int]], None]
Respond = Callable[[PullReply], None]


def plan_item(
    local_ids: list[list[int]],
    remote_ids: list[list[int]],
    local: tuple[GroupLayout, ...],
    remote: list[GroupGeometry],
    slices: list[Slice] | None = None,
) -> tuple[TransferPlan, list[list[int]]]:
    """One request's segments over all groups, and per group the decoder slots written.

    ``slices``: per group, the bytes of each block to copy (KV heads, when the TP sizes
    differ); None copies whole blocks."""
    if len(local_ids) != len(local) or len(remote_ids) != len(local):
        raise ValueError(
            f"block ids for {len(remote_ids)} groups from the decoder, {len(local_ids)} held, "
            f"{len(local)} expected"
        )
    plans, written = [], []
    for g, (mine, theirs) in enumerate(zip(local_ids, remote_ids, strict=True)):
        src, dst = pair_blocks(mine, theirs)
        r = remote[g]
        dst_layout = RegionLayout(tuple(r.region_bases), r.block_len, r.block_stride, r.num_blocks)
        part = slices[g] if slices is not None else None
        plans.append(build_transfer_plan(src, dst, local[g].layout, dst_layout, part))
        written.append(dst)
    return TransferPlan.concat(plans), written


@dataclass(frozen=True)
class PushLimits:
    ready_timeout_s: float
    max_segments_per_batch: int
    max_batch_bytes: int = 256 << 20
    max_items_per_pull: int = 256
    max_queued_pushes: int = 1024
    failed_push_hold_s: float = 0.0


@dataclass(frozen=True)
class TpPlace:
    """This prefiller worker's place in its TP group, and the model's KV heads in all."""

    total_heads: int
    size: int
    rank: int


@dataclass(frozen=True)
class _Part:
    """How this rank serves one decoder rank: pulls per request, bytes per block, or why
    it cannot (``error``)."""

    parts: int = 1
    slices: list[Slice] | None = None
    error: str | None = None


@dataclass(frozen=True)
class _Job:
    req: PullRequest
    item: PullItem
    local_ids: list[list[int]]
    respond: Respond
    slices: list[Slice] | None = None


class PushHandler:
    """Serve decoded pulls: claim or park, check, plan, push, finish. No sockets here."""

    def __init__(
        self,
        registry: SendRegistry,
        groups: tuple[GroupLayout, ...],
        write: WriteFn,
        limits: PushLimits,
        recorder: TransferRecorder,
        executor: Executor,
        compat: Compat | None = None,
        reader: MemoryReader | None = None,
        tp: TpPlace | None = None,
    ) -> None:
        self._tp = tp
        self._registry = registry
        self._groups = groups
        self._write = write
        self._limits = limits
        self._rec = recorder
        self._executor = executor
        self._compat = compat
        self._reader = reader
        self._lock = threading.Lock()
        self._queues: dict[str, deque[_Job]] = {}  # decoder session -> pushes waiting
        self._queued = 0

    # --- entry points ----------------------------------------------------------------------

    def accept(self, req: PullRequest, respond: Respond) -> None:
        """Start serving every item of ``req``; each item gets exactly one reply, later."""
        if len(req.items) > self._limits.max_items_per_pull:
            respond(
                PullReply(
                    req.msg_id,
                    "",
                    ok=False,
                    error=f"too many items in one pull: {len(req.items)} > "
                    f"{self._limits.max_items_per_pull}",
                )
            )
            return
        part = self._part_of(req) if any(not i.is_release for i in req.items) else _Part()
        for item in req.items:
            self._start(req, item, respond, part)

    def _part_of(self, req: PullRequest) -> _Part:
        """Check the decoder's layout and topology once per message (see connector.tp)."""
        tp = self._tp
        if req.compat is not None and self._compat is not None:
            bad = self._compat.mismatch(req.compat)
            if bad:
                return _Part(error=bad)
        if tp is None or req.tp_size == tp.size:
            if tp is not None and req.tp_rank != tp.rank:
                return _Part(
                    error=f"decoder rank {req.tp_rank} pulled from prefiller rank {tp.rank} "
                    "(same TP size: each rank pulls from its own peer rank)"
                )
            return _Part(error=layout_mismatch(self._groups, req.groups))
        try:
            cov = cover(tp.total_heads, tp.size, req.tp_size)
            mine = [p for p in cov.pulls_of(req.tp_rank) if p.prefill_rank == tp.rank]
            if not mine:
                return _Part(
                    error=f"decoder rank {req.tp_rank}/{req.tp_size} needs none of the KV heads "
                    f"of prefiller rank {tp.rank}/{tp.size}"
                )
            heads = (
                rank_heads(tp.total_heads, tp.size, tp.rank).count,
                rank_heads(tp.total_heads, req.tp_size, req.tp_rank).count,
            )
        except ValueError as exc:
            return _Part(error=f"TP {tp.size} -> {req.tp_size}: {exc}")
        bad = layout_mismatch(self._groups, req.groups, heads)
        if bad:
            return _Part(error=bad)
        slices = [
            byte_slice(mine[0], tp.total_heads, tp.size, req.tp_size, g.head_bytes or 0)
            for g in self._groups
        ]
        return _Part(cov.expected_at(tp.rank), slices)

    def tick(self) -> None:
        """Time out parked pulls (called by the socket loop, a few times a second)."""
        self._registry.expire_parked()

    # --- per item --------------------------------------------------------------------------

    def _start(self, req: PullRequest, item: PullItem, respond: Respond, part: _Part) -> None:
        tid = item.transfer_id
        wait_s = min(self._limits.ready_timeout_s, req.deadline_ms / 1000.0 - time.time())
        parts = 0 if item.is_release else part.parts

        def woken(handed_over: bool) -> None:
            if not handed_over:
                self._refuse(req, tid, respond, ClaimError(f"{safe(tid)}: not handed over"))
                return
            try:
                ids = self._registry.claim(tid, item.secret, parts)
            except ClaimError as exc:
                self._refuse(req, tid, respond, exc)
                return
            if ids is None:
                self._refuse(req, tid, respond, ClaimError(f"{safe(tid)}: woken, not held"))
                return
            self._claimed(req, item, ids, respond, part)

        try:
            ids = self._registry.claim_or_park(tid, item.secret, wait_s, woken, parts)
        except ClaimError as exc:
            self._refuse(req, tid, respond, exc)
            return
        if ids is not None:
            self._claimed(req, item, ids, respond, part)

    def _refuse(self, req: PullRequest, tid: str, respond: Respond, exc: ClaimError) -> None:
        self._rec.event("refused")
        logger.warning(
            "pull %s from %s refused: %s", safe(tid), safe(req.decoder_engine_id), exc.detail
        )
        respond(PullReply(req.msg_id, tid, ok=False, error=exc.public))

    def _fail(self, req: PullRequest, tid: str, respond: Respond, error: str) -> None:
        """Refuse a claimed request: the caller proved its secret, so the blocks go now."""
        self._registry.finish(tid, Outcome.FAILED)
        self._rec.event("refused")
        logger.warning("pull %s from %s refused: %s", safe(tid), safe(req.decoder_engine_id), error)
        respond(PullReply(req.msg_id, tid, ok=False, error=error))

    def _claimed(
        self, req: PullRequest, item: PullItem, ids: list[list[int]], respond: Respond, part: _Part
    ) -> None:
        tid = item.transfer_id
        if item.is_release:  # the registry ended the request in the claim
            logger.debug("transfer %s released by decoder (nothing to send)", safe(tid))
            respond(PullReply(req.msg_id, tid, ok=True))
            return
        late_s = time.time() - req.deadline_ms / 1000.0
        if late_s > 0:
            self._fail(
                req,
                tid,
                respond,
                f"pull for {safe(tid)} arrived {late_s:.3f}s after the decoder's deadline "
                "(a delayed message, or clocks out of sync)",
            )
            return
        if part.error:
            self._fail(req, tid, respond, part.error)
            return
        if self._compat is not None and req.compat is None:
            self._fail(req, tid, respond, self._compat.mismatch(None))
            return
        self._enqueue(_Job(req, item, ids, respond, part.slices))

    # --- per decoder queues ----------------------------------------------------------------

    def _enqueue(self, job: _Job) -> None:
        session = job.req.decoder_session
        with self._lock:
            if self._queued >= self._limits.max_queued_pushes:
                full = True
            else:
                full = False
                self._queued += 1
                queue = self._queues.get(session)
                start = queue is None
                if queue is None:
                    queue = self._queues[session] = deque()
                queue.append(job)
        if full:
            self._fail(
                job.req, job.item.transfer_id, job.respond, "prefiller busy: push queue full"
            )
            return
        if start:
            try:
                self._executor.submit(self._drain, session)
            except RuntimeError:  # shutting down: end everything queued for this decoder
                for left in self._take_queue(session):
                    self._fail(left.req, left.item.transfer_id, left.respond, "shutting down")

    def _take_queue(self, session: str) -> list[_Job]:
        with self._lock:
            jobs = list(self._queues.pop(session, ()))
            self._queued -= len(jobs)
        return jobs

    def _drain(self, session: str) -> None:
        """Run one decoder's pushes one after another (one in flight per decoder)."""
        while True:
            with self._lock:
                queue = self._queues[session]
                if not queue:
                    del self._queues[session]
                    return
                job = queue.popleft()
                self._queued -= 1
            unreachable = False
            try:
                reply = self._push(job)
                unreachable = reply.error.startswith(ENGINE_FAILED)
            except Exception as exc:  # never leave a claimed request or a queue behind
                self._registry.finish(job.item.transfer_id, Outcome.FAILED)
                logger.exception("push of %s failed unexpectedly", safe(job.item.transfer_id))
                reply = PullReply(job.req.msg_id, job.item.transfer_id, ok=False, error=str(exc))
            job.respond(reply)
            if unreachable:
                self._fail_queued(session)

    def _fail_queued(self, session: str) -> None:
        """The engine could not write to this decoder (dead, frozen past the transfer
        timeout, or cut off): the pushes queued behind would each wait out the same
        timeout, so they fail now and their blocks go back (the decoder recomputes)."""
        with self._lock:  # the queue itself stays: this thread is still its drainer
            queue = self._queues[session]
            left = list(queue)
            queue.clear()
            self._queued -= len(left)
        if not left:
            return
        logger.warning(
            "decoder %s unreachable: failing its %d queued pushes now", safe(session), len(left)
        )
        for job in left:
            self._rec.event("push_failures")
            self._registry.finish(job.item.transfer_id, Outcome.FAILED)
            job.respond(
                PullReply(
                    job.req.msg_id,
                    job.item.transfer_id,
                    ok=False,
                    error=f"{ENGINE_FAILED}: an earlier push to it failed",
                )
            )

    def _push(self, job: _Job) -> PullReply:
        req, tid = job.req, job.item.transfer_id
        deadline = req.deadline_ms / 1000.0
        t0 = time.perf_counter()
        try:
            plan, written = plan_item(
                job.local_ids, job.item.block_ids, self._groups, req.groups, job.slices
            )
            for src, dst, lengths in plan.batches(
                self._limits.max_segments_per_batch, self._limits.max_batch_bytes
            ):
                if time.time() > deadline:
                    raise TimeoutError("the decoder's deadline passed before the push finished")
                self._write(req.decoder_session, src, dst, lengths)
            digest = b""
            if req.want_digest and self._reader is not None:
                digest = keyed_digest(
                    self._reader, job.item.secret, plan.src.tolist(), plan.lengths.tolist()
                )
        except Exception as exc:
            # Whatever went wrong, a claimed request must end here or its blocks are stranded
            # (expiry skips claimed requests). After an engine failure the engine may still
            # read these blocks later, so they stay put a while (failed_push_hold_s).
            hold = self._limits.failed_push_hold_s if isinstance(exc, TransferError) else 0.0
            self._registry.finish(tid, Outcome.FAILED, hold)
            self._rec.event("push_failures")
            expected = isinstance(exc, (ValueError, TransferError, TimeoutError))
            logger.error(
                "transfer %s to %s failed: %s",
                safe(tid),
                safe(req.decoder_session),
                exc,
                exc_info=not expected,
            )
            error = str(exc)[:450]
            if isinstance(exc, TransferError):
                error = f"{ENGINE_FAILED}: {error}"
            return PullReply(req.msg_id, tid, ok=False, error=error)
        elapsed = time.perf_counter() - t0
        self._registry.finish(tid, Outcome.SENT)
        n_blocks = sum(len(w) for w in written)
        self._rec.push(elapsed, plan.total_bytes, n_blocks, len(plan))
        logger.info(
            "transfer %s: pushed %d blocks as %d segments, %d bytes in %.2f ms to %s",
            safe(tid),
            n_blocks,
            len(plan),
            plan.total_bytes,
            elapsed * 1e3,
            safe(req.decoder_session),
        )
        return PullReply(
            req.msg_id,
            tid,
            ok=True,
            num_bytes=plan.total_bytes,
            num_segments=len(plan),
            written=written,
            digest=digest,
        )


class SideChannelServer:
    """The ROUTER socket thread plus the sender pool. Owns every socket and thread it makes."""

    def __init__(
        self,
        bind_host: str,
        port: int,
        make_handler: Callable[[Executor], PushHandler],
        threads: int,
        max_message_bytes: int = 16 << 20,
    ) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="pd-kv-send")
        self._handler = make_handler(self._pool)
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # A bigger frame disconnects the peer before anything is allocated for it.
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        host = f"[{bind_host}]" if ":" in bind_host else bind_host
        if ":" in bind_host:
            self._router.setsockopt(zmq.IPV6, 1)
        self.endpoint = f"tcp://{host}:{port}"
        self._router.bind(self.endpoint)
        self._inbox = f"inproc://pd-kv-replies-{id(self)}"
        self._replies_in = self._ctx.socket(zmq.PULL)
        self._replies_in.bind(self._inbox)
        self._replies_out = self._ctx.socket(zmq.PUSH)
        self._replies_out.setsockopt(zmq.LINGER, 0)
        self._replies_out.connect(self._inbox)
        self._out_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pd-kv-side-channel", daemon=True)
        self.malformed = 0

    def start(self) -> None:
        self._thread.start()
        logger.info("KV side channel listening on %s", self.endpoint)

    def _responder(self, ident: bytes) -> Respond:
        def respond(reply: PullReply) -> None:
            with self._out_lock:
                if not self._stop.is_set():
                    self._replies_out.send_multipart([ident, encode(reply)])

        return respond

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
            self._handler.tick()

    def _on_message(self, frames: list[bytes]) -> None:
        ident, payload = frames[0], frames[-1]
        try:
            if len(frames) < 2:
                raise WireError("empty message")
            req = decode_pull(payload)
        except WireError as exc:
            self.malformed += 1
            logger.warning("malformed pull (%d bytes): %s", len(payload), safe(str(exc)))
            self._router.send_multipart(
                [ident, encode(PullReply(-1, "", ok=False, error=str(exc)[:500]))]
            )
            return
        try:
            self._handler.accept(req, self._responder(ident))
        except Exception as exc:  # never let one pull kill the socket thread
            logger.exception("pull %d failed unexpectedly", req.msg_id)
            self._router.send_multipart(
                [ident, encode(PullReply(req.msg_id, "", ok=False, error=f"internal error: {exc}"))]
            )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=True, cancel_futures=True)
        for sock in (self._router, self._replies_in, self._replies_out):
            sock.close(linger=0)
        self._ctx.term()


class InlineExecutor(Executor):
    """Runs each push on the caller's thread: for benchmarks and tests of the handler alone."""

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        from concurrent.futures import Future

        fut: Future[object] = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the future, as a real executor does
            fut.set_exception(exc)
        return fut
