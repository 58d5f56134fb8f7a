"""Decoder side: ask prefillers for blocks over the side channel, with timeouts.

An asyncio loop runs in its own thread with one DEALER socket per prefiller worker.
All requests for the same prefiller in one engine step share one message. Every pull
ends as done or failed within its timeout; failures are reported to vLLM so the engine
recomputes or fails the request instead of decoding from unwritten blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import zmq
import zmq.asyncio
import zmq.utils.monitor

from connector.digest import MemoryReader, keyed_digest, written_segments
from connector.layout import GroupLayout, geometry
from connector.log import get_logger
from connector.logsafe import safe
from connector.recorder import TransferRecorder
from connector.settings import ConnectorSettings
from connector.tp import Slice
from connector.wire import (
    ENGINE_FAILED,
    PROTOCOL_VERSION,
    Compat,
    PullItem,
    PullReply,
    PullRequest,
    WireError,
    decode_reply,
    encode,
)

logger = get_logger(__name__)

# A prefiller whose side-channel connection has been refused or closed this long is dead to
# a new pull (a restarted one accepts at once, so this only delays the recompute).
DEAD_PEER_S = 1.0


@dataclass(frozen=True)
class PullSpec:
    """One decoder request's pull (no block ids: a release, nothing reported back)."""

    request_id: str
    transfer_id: str
    secret: str
    # Per KV cache group, the decoder's block slots to fill (positional, 0 = skip).
    block_ids: list[list[int]]
    peer: str  # tcp://host:port of the prefiller worker's side channel
    # Per group, the bytes of each block this pull fills (KV heads from one prefiller rank
    # when the TP sizes differ); None: whole blocks. A request may need several pulls.
    slices: tuple[Slice, ...] | None = None

    @property
    def is_release(self) -> bool:
        return not any(self.block_ids)


def check_reply(
    reply: PullReply,
    asked: list[list[int]],
    groups: tuple[GroupLayout, ...],
    slices: tuple[Slice, ...] | None = None,
) -> str | None:
    """Why an "ok" reply does not match what we asked for, or None when it does.

    The prefiller must name the slots it wrote: each one we asked for, at most once, and
    a byte count that is exactly those blocks (or the asked slice of each) in every region
    of their group.
    """
    if len(reply.written) != len(groups):
        return f"reply names written blocks for {len(reply.written)} groups, not {len(groups)}"
    expected_bytes = 0
    for g, (written, want, lay) in enumerate(zip(reply.written, asked, groups, strict=True)):
        allowed = {b for b in want if b}
        if len(set(written)) != len(written) or not allowed.issuperset(written):
            return f"reply claims blocks of group {g} that were not asked for"
        per_block = slices[g].length if slices is not None else lay.layout.block_len
        expected_bytes += len(written) * per_block * len(lay.layout.base_addrs)
    if reply.num_bytes != expected_bytes:
        return f"reply says {reply.num_bytes} bytes for blocks that hold {expected_bytes}"
    return None


class PullClient:
    def __init__(
        self,
        engine_id: str,
        session: str,
        groups: tuple[GroupLayout, ...],
        settings: ConnectorSettings,
        recorder: TransferRecorder,
        compat: Compat | None = None,
        reader: MemoryReader | None = None,
        tp: tuple[int, int] = (1, 0),
    ) -> None:
        self._tp_size, self._tp_rank = tp
        # Requests pulled in several parts (one per prefiller rank): parts left, any failed.
        self._parts: dict[str, list[int]] = {}
        self._engine_id = engine_id
        self._session = session
        self._groups = groups
        self._geometry = [geometry(g) for g in groups]
        self._layouts = [
            (g.layout.base_addrs, g.layout.block_len, g.layout.block_stride) for g in groups
        ]
        self._settings = settings
        self._timeout = settings.pull_timeout_s
        self._rec = recorder
        self._compat = compat
        self._reader = reader if settings.verify_digest else None
        # The prefiller refuses a pull, and starts no push batch, after this budget (sent as an
        # absolute deadline), so a late push cannot land in blocks vLLM gave back after our
        # timeout; the reserve covers the last batch in flight and clock differences.
        self._budget_s = settings.pull_budget_s()
        self._last_used: dict[str, float] = {}
        # Prefillers whose connection closed or was refused, since when (monitor events).
        self._down_since: dict[str, float] = {}
        self._msg_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._failed: set[str] = set()
        # Pulls (not releases) awaiting their reply, by (message, transfer): a level for
        # /metrics, left together with the result under the lock so no step sees both.
        self._waiting: set[tuple[int, str]] = set()
        self._loop = asyncio.new_event_loop()
        self._ctx = zmq.asyncio.Context()
        self._sockets: dict[str, zmq.asyncio.Socket] = {}
        self._pending: dict[str, dict[tuple[int, str], asyncio.Future[PullReply]]] = defaultdict(
            dict
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pd-kv-recv", daemon=True
        )
        self._closed = False

    def start(self) -> None:
        self._thread.start()
        self._loop.call_soon_threadsafe(self._spawn, self._close_idle_peers())

    # --- called from vLLM's worker thread -------------------------------------------------

    def submit(self, specs: list[PullSpec]) -> None:
        if specs and not self._closed:
            self._loop.call_soon_threadsafe(self._dispatch, specs)

    def take_results(self) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids since the last call; failed ⊆ finished."""
        with self._lock:
            done, failed = self._done | self._failed, self._failed
            self._done, self._failed = set(), set()
        return done, failed

    def fail_now(self, request_id: str, why: str) -> None:
        """Report a request's load as failed without pulling (vLLM recomputes or fails it)."""
        self._rec.event("pull_failures")
        logger.error("request %s: KV cannot be pulled: %s", safe(request_id), why)
        with self._lock:
            self._failed.add(request_id)

    def num_waiting(self) -> int:
        """Pulls waiting for their reply now (a level for /metrics)."""
        with self._lock:
            return len(self._waiting)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            try:
                fut.result(timeout=5)
            except Exception:
                logger.warning("receiver shutdown did not finish cleanly", exc_info=True)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._loop.close()
        self._ctx.term()

    # --- inside the loop thread ------------------------------------------------------------

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _socket(self, peer: str) -> zmq.asyncio.Socket:
        sock = self._sockets.get(peer)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, self._settings.max_message_bytes)
            if peer.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            monitor = sock.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
            )
            sock.connect(peer)
            self._sockets[peer] = sock
            self._spawn(self._read_replies(peer, sock))
            self._spawn(self._watch(peer, sock, monitor))
        return sock

    async def _watch(
        self, peer: str, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket
    ) -> None:
        """Fail the pulls in flight to a prefiller whose connection closed.

        A closed connection means the prefiller process is gone (or shut down after its
        pushes ended): its replies can never come, so waiting out the pull timeout (25 s+)
        only delays the recompute. Only a close counts, not silence: a frozen or unreachable
        prefiller may still push before the pull's deadline, so it is left to the timeout.
        """
        try:
            while True:
                frames = await monitor.recv_multipart()
                event = zmq.utils.monitor.parse_monitor_message(frames)["event"]
                if event == zmq.EVENT_MONITOR_STOPPED:
                    return
                if self._sockets.get(peer) is not sock:
                    continue
                if event == zmq.EVENT_CONNECTED:
                    self._down_since.pop(peer, None)
                elif event == zmq.EVENT_CONNECT_RETRIED:  # refused or failed: nobody there
                    self._down_since.setdefault(peer, time.monotonic())
                elif event == zmq.EVENT_DISCONNECTED:
                    self._down_since.setdefault(peer, time.monotonic())
                    lost = list(self._pending.get(peer, {}))
                    if lost:
                        self._spawn(self._peer_lost(peer, lost))
        except (zmq.ZMQError, asyncio.CancelledError):
            return
        finally:
            monitor.close(linger=0)

    async def _peer_lost(self, peer: str, keys: list[tuple[int, str]]) -> None:
        # Bytes the dying process had already handed to the kernel may still land.
        await asyncio.sleep(self._settings.late_write_grace_s)
        pending = self._pending.get(peer, {})
        error = f"prefiller at {peer} closed the side channel (process gone?)"
        failed = 0
        for key in keys:
            fut = pending.pop(key, None)
            if fut is not None and not fut.done():
                fut.set_result(PullReply(key[0], key[1], ok=False, error=error))
                failed += 1
        if failed:
            logger.warning("%s: failed %d pulls in flight at once", error, failed)

    async def _close_idle_peers(self) -> None:
        """Close sockets (and their reader tasks) to prefillers we have not used lately."""
        idle_s = self._settings.peer_idle_s
        while True:
            await asyncio.sleep(min(idle_s / 2, 30.0))
            now = time.monotonic()
            for peer in list(self._sockets):
                if self._pending.get(peer) or now - self._last_used.get(peer, now) < idle_s:
                    continue
                sock = self._sockets.pop(peer)
                self._pending.pop(peer, None)
                self._last_used.pop(peer, None)
                self._down_since.pop(peer, None)
                sock.disable_monitor()  # its watcher ends on MONITOR_STOPPED
                sock.close(linger=0)  # its reader task ends on the closed socket
                logger.debug("closed idle side channel to %s", peer)

    def _chunks(self, specs: list[PullSpec]) -> list[list[PullSpec]]:
        """Split one peer's step into messages under the prefiller's item and size caps."""
        max_items = self._settings.max_items_per_pull
        # msgpack ints take at most 9 bytes; keep well under the frame cap.
        max_ids = self._settings.max_message_bytes // 20
        out: list[list[PullSpec]] = [[]]
        ids = 0
        for spec in specs:
            n = sum(len(g) for g in spec.block_ids)
            if out[-1] and (len(out[-1]) >= max_items or ids + n > max_ids):
                out.append([])
                ids = 0
            out[-1].append(spec)
            ids += n
        return out

    def _dispatch(self, specs: list[PullSpec]) -> None:
        by_peer: dict[str, list[PullSpec]] = defaultdict(list)
        for spec in specs:
            by_peer[spec.peer].append(spec)
            if not spec.is_release:
                self._parts.setdefault(spec.request_id, [0, 0])[0] += 1
        for peer, all_specs in by_peer.items():
            for group in self._chunks(all_specs):
                self._dispatch_one(peer, group)

    def _dispatch_one(self, peer: str, group: list[PullSpec]) -> None:
        self._last_used[peer] = time.monotonic()
        wants_blocks = any(not s.is_release for s in group)
        msg = PullRequest(
            version=PROTOCOL_VERSION,
            msg_id=next(self._msg_ids),
            decoder_engine_id=self._engine_id,
            decoder_session=self._session,
            groups=self._geometry,
            deadline_ms=int((time.time() + self._budget_s) * 1000),
            items=[PullItem(s.transfer_id, s.secret, s.block_ids) for s in group],
            compat=self._compat,
            want_digest=self._reader is not None and wants_blocks,
            tp_size=self._tp_size,
            tp_rank=self._tp_rank,
        )
        pending = self._pending[peer]
        for spec in group:
            fut: asyncio.Future[PullReply] = self._loop.create_future()
            pending[(msg.msg_id, spec.transfer_id)] = fut
            self._spawn(self._await_one(peer, msg.msg_id, spec, fut))
        self._spawn(self._send(peer, msg))

    async def _send(self, peer: str, msg: PullRequest) -> None:
        # With IMMEDIATE the socket only takes a message once connected; giving up here
        # cancels it, so a pull is never delivered after the decoder stopped waiting. A
        # prefiller whose connection is refused or closed is given up on after
        # DEAD_PEER_S, not the whole budget: a dead process never answers.
        send = asyncio.ensure_future(self._socket(peer).send(encode(msg)))
        deadline = time.monotonic() + self._budget_s
        try:
            while True:
                left = deadline - time.monotonic()
                done, _ = await asyncio.wait({send}, timeout=min(left, DEAD_PEER_S / 4))
                if done:
                    send.result()
                    return
                down = self._down_since.get(peer)
                if down is not None and time.monotonic() - down >= DEAD_PEER_S:
                    send.cancel()
                    self._fail_message(
                        peer, msg.msg_id, f"prefiller at {peer} is unreachable (connection refused)"
                    )
                    return
                if left <= 0:
                    send.cancel()
                    self._fail_message(
                        peer,
                        msg.msg_id,
                        f"side channel {peer} not reachable within {self._budget_s:g}s",
                    )
                    return
        except zmq.ZMQError as exc:
            self._fail_message(peer, msg.msg_id, f"send to {peer} failed: {exc}")
        except asyncio.CancelledError:
            send.cancel()
            raise

    async def _read_replies(self, peer: str, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                data = await sock.recv()
            except zmq.ZMQError as exc:
                # Pending pulls to this peer then end by their own timeouts.
                if self._sockets.get(peer) is sock:
                    logger.error("side channel to %s broke: %s", peer, exc)
                    self._sockets.pop(peer, None)
                sock.close(linger=0)
                return
            try:
                reply = decode_reply(data)
            except WireError as exc:
                logger.warning("unreadable reply from %s: %s", peer, exc)
                continue
            if not reply.transfer_id:
                self._fail_message(peer, reply.msg_id, reply.error or "rejected")
                continue
            self._last_used[peer] = time.monotonic()
            fut = self._pending[peer].pop((reply.msg_id, reply.transfer_id), None)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    def _fail_message(self, peer: str, msg_id: int, error: str) -> None:
        pending = self._pending[peer]
        # An unreadable message is answered with msg_id -1: fail whatever is pending there.
        keys = [k for k in pending if k[0] == msg_id or msg_id < 0]
        for key in keys:
            fut = pending.pop(key)
            if not fut.done():
                fut.set_result(PullReply(key[0], key[1], ok=False, error=error))

    async def _await_one(
        self, peer: str, msg_id: int, spec: PullSpec, fut: asyncio.Future[PullReply]
    ) -> None:
        key = (msg_id, spec.transfer_id)
        if not spec.is_release:
            with self._lock:
                self._waiting.add(key)
        try:
            await self._await_reply(peer, msg_id, spec, fut)
        finally:
            with self._lock:
                self._waiting.discard(key)

    async def _await_reply(
        self, peer: str, msg_id: int, spec: PullSpec, fut: asyncio.Future[PullReply]
    ) -> None:
        t0 = time.perf_counter()
        try:
            reply = await asyncio.wait_for(fut, self._timeout)
        except TimeoutError:
            self._pending[peer].pop((msg_id, spec.transfer_id), None)
            reply = PullReply(
                msg_id, spec.transfer_id, ok=False, error=f"no reply within {self._timeout:g}s"
            )
            if not spec.is_release and self._settings.late_write_grace_s > 0:
                # Bytes a frozen or partitioned path still held may land right after a
                # freeze ends; let them land before vLLM may hand these blocks to another
                # request.
                await asyncio.sleep(self._settings.late_write_grace_s)
        if not reply.ok and reply.error.startswith(ENGINE_FAILED) and not spec.is_release:
            # The prefiller's engine failed its write to us and may retry it when the path
            # heals: give bytes already on their way time to land before vLLM may reuse
            # these blocks (the prefiller keeps its own blocks for failed_push_hold_s).
            await asyncio.sleep(self._settings.late_write_grace_s)
        elapsed = time.perf_counter() - t0
        if reply.ok and not spec.is_release:
            problem = check_reply(reply, spec.block_ids, self._groups, spec.slices)
            if problem is None and self._reader is not None:
                problem = self._check_digest(reply, spec)
            if problem is not None:
                reply = PullReply(msg_id, spec.transfer_id, ok=False, error=problem)
        if spec.is_release:  # the prefiller frees; nothing to report to vLLM
            if not reply.ok:
                logger.warning(
                    "release of %s at %s failed: %s",
                    safe(spec.transfer_id),
                    peer,
                    safe(reply.error),
                )
            return
        # A request pulled in parts is reported once every part ended: failing it while
        # another part's push may still land would let vLLM reuse blocks being written.
        parts = self._parts.get(spec.request_id)
        if parts is not None:
            parts[0] -= 1
            parts[1] |= not reply.ok
        with self._lock:
            if parts is None or parts[0] <= 0:
                self._parts.pop(spec.request_id, None)
                whole_ok = reply.ok and not (parts and parts[1])
                (self._done if whole_ok else self._failed).add(spec.request_id)
            self._waiting.discard((msg_id, spec.transfer_id))
        if reply.ok:
            self._rec.pull(elapsed, reply.num_bytes)
            logger.info(
                "request %s: received %d blocks (%d bytes, %d segments) from %s in %.2f ms",
                safe(spec.request_id),
                sum(len(g) for g in reply.written),
                reply.num_bytes,
                reply.num_segments,
                peer,
                elapsed * 1e3,
            )
        else:
            self._rec.event("pull_failures")
            logger.error(
                "request %s: pull from %s failed: %s",
                safe(spec.request_id),
                peer,
                safe(reply.error),
            )

    def _check_digest(self, reply: PullReply, spec: PullSpec) -> str | None:
        assert self._reader is not None
        if not reply.digest:
            return "digest check on, but the prefiller sent no digest"
        addrs, lengths = written_segments(reply.written, self._layouts, spec.slices)
        if keyed_digest(self._reader, spec.secret, addrs, lengths) != reply.digest:
            self._rec.event("digest_mismatches")
            return "KV digest mismatch: the received blocks differ from what was sent"
        return None

    async def _shutdown(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sock in self._sockets.values():
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            sock.close(linger=0)
        self._sockets.clear()
