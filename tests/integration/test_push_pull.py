"""Two processes, the real Mooncake engine over TCP, CPU buffers: every byte checked."""

from __future__ import annotations

import time

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connector.scheduler import P2pMetadata, RecvTask
from connector.send_registry import UNAVAILABLE
from connector.settings import ConnectorSettings
from connector.wire import decode_reply, encode
from connector.worker import P2pWorker
from tests.integration.kvbuf import block_bytes, make_caches
from tests.integration.proc import WorkerProc
from tests.servers import free_port

pytestmark = pytest.mark.integration

CFG = {"num_blocks": 64, "layers": 3, "heads": 2, "block_size": 32, "head": 32, "seed": 1234}


class Prefiller(WorkerProc):
    def __init__(self, port: int | None = None, **overrides) -> None:
        self.port = port or free_port()
        cfg = {**CFG, "port": self.port, **overrides}
        super().__init__("prefiller_proc", cfg)
        _, self.caches = make_caches(cfg, seed=cfg["seed"])  # same bytes, for checking


@pytest.fixture(scope="module")
def prefiller():
    p = Prefiller()
    yield p
    p.close()


@pytest.fixture(scope="module")
def decoder():
    settings = ConnectorSettings.load(
        {"protocol": "tcp", "host": "127.0.0.1", "pull_timeout_s": 3}, env={}
    )
    w = P2pWorker(settings, "decode-test", CFG["num_blocks"], 0, free_port(), False, True)
    buf, caches = make_caches(CFG, seed=None)
    w.register_kv_caches(caches)
    yield w, buf, caches
    w.shutdown()


def pull(
    decoder,
    port: int,
    request_id: str,
    transfer_id: str,
    dst: list[int],
    timeout: float = 15,
    secret: str = "k",
):
    w, _, _ = decoder
    task = RecvTask(request_id, transfer_id, secret, [dst], "127.0.0.1", port)
    w.start_load_kv(P2pMetadata(recv=[task]))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, done, failed = w.get_transfer_results()
        if request_id in done:
            return request_id not in failed
        assert not done, f"unexpected results {done}"
        time.sleep(0.01)
    raise AssertionError(f"{request_id} never finished")


def assert_copied(prefiller, decoder, src: list[int], dst: list[int]) -> None:
    _, buf, caches = decoder
    for layer in range(CFG["layers"]):
        for s, d in zip(src, dst, strict=True):
            assert block_bytes(caches, layer, d) == block_bytes(prefiller.caches, layer, s), (
                layer,
                s,
                d,
            )
    # Nothing outside the requested blocks was written.
    untouched = [b for b in range(CFG["num_blocks"]) if b not in dst]
    for layer in range(CFG["layers"]):
        for b in untouched:
            assert not any(block_bytes(caches, layer, b))
    buf.zero_()


def test_null_block_is_never_read_or_written(prefiller, decoder):
    """Block 0 is vLLM's shared null block: pairs with it on either side are skipped."""
    prefiller.call(cmd="hold", transfer_id="t-null", block_ids=[0, 5, 6, 7])
    assert pull(decoder, prefiller.port, "r-null", "t-null", [9, 10, 0, 11])
    # (0 -> 9) and (6 -> 0) are skipped: decoder blocks 9 and 0 stay untouched.
    assert_copied(prefiller, decoder, [5, 7], [10, 11])


def test_non_contiguous_blocks_arrive_byte_exact(prefiller, decoder):
    src = [3, 4, 5, 9, 10, 20, 21, 22, 40]
    dst = [7, 8, 30, 31, 32, 2, 50, 51, 52]
    prefiller.call(cmd="hold", transfer_id="t-nc", block_ids=src)
    assert pull(decoder, prefiller.port, "r-nc", "t-nc", dst)
    assert_copied(prefiller, decoder, src, dst)
    res = prefiller.call(cmd="results")
    assert "t-nc" in res["finished_sending"]


def test_partial_prefix_gets_the_tail(prefiller, decoder):
    prefiller.call(cmd="hold", transfer_id="t-tail", block_ids=[11, 12, 13, 14, 15])
    assert pull(decoder, prefiller.port, "r-tail", "t-tail", [60, 61])
    assert_copied(prefiller, decoder, [14, 15], [60, 61])


def test_unknown_request_id_is_refused_at_once(prefiller, decoder):
    t0 = time.monotonic()
    assert pull(decoder, prefiller.port, "r-unknown", "t-never", [1, 2]) is False
    assert time.monotonic() - t0 < 0.9  # never announced: no wait at all
    assert_copied(prefiller, decoder, [], [])


def test_pull_before_hand_over_parks_and_is_served(prefiller, decoder):
    """The scheduler announced the request; its blocks reach the worker a moment later."""
    prefiller.call(cmd="expect", transfer_id="t-park")
    w = decoder[0]
    w.start_load_kv(
        P2pMetadata(recv=[RecvTask("r-park", "t-park", "k", [[40]], "127.0.0.1", prefiller.port)])
    )
    time.sleep(0.3)
    assert prefiller.call(cmd="results")["parked"] == 1
    prefiller.call(cmd="hold", transfer_id="t-park", block_ids=[17])
    deadline = time.monotonic() + 5
    done: set[str] = set()
    while "r-park" not in done and time.monotonic() < deadline:
        _, d, failed = w.get_transfer_results()
        assert not failed
        done |= d
        time.sleep(0.01)
    assert "r-park" in done
    assert_copied(prefiller, decoder, [17], [40])


def test_expected_pull_times_out_after_the_ready_timeout(prefiller, decoder):
    prefiller.call(cmd="expect", transfer_id="t-never-held")
    t0 = time.monotonic()
    assert pull(decoder, prefiller.port, "r-nh", "t-never-held", [1]) is False
    assert 0.8 < time.monotonic() - t0 < 3  # ready_timeout_s = 1
    assert prefiller.call(cmd="results")["parked"] == 0


def test_duplicate_pull_is_refused_and_freed_once(prefiller, decoder):
    prefiller.call(cmd="hold", transfer_id="t-dup", block_ids=[1, 2])
    assert pull(decoder, prefiller.port, "r-dup1", "t-dup", [5, 6])
    decoder[1].zero_()
    assert pull(decoder, prefiller.port, "r-dup2", "t-dup", [5, 6]) is False
    assert_copied(prefiller, decoder, [], [])  # the replay wrote nothing
    res = prefiller.call(cmd="results")
    assert res["finished_sending"].count("t-dup") <= 1
    assert prefiller.call(cmd="results")["finished_sending"] == []


def test_release_frees_without_transfer(prefiller, decoder):
    prefiller.call(cmd="hold", transfer_id="t-rel", block_ids=[30, 31])
    w = decoder[0]
    task = RecvTask("r-rel", "t-rel", "k", [[]], "127.0.0.1", prefiller.port)
    w.start_load_kv(P2pMetadata(recv=[task]))
    deadline = time.monotonic() + 10
    freed: list[str] = []
    while time.monotonic() < deadline and "t-rel" not in freed:
        freed += prefiller.call(cmd="results")["finished_sending"]
        time.sleep(0.05)
    assert "t-rel" in freed
    assert w.get_transfer_results()[1] == set()  # a release is not reported to vLLM
    assert_copied(prefiller, decoder, [], [])


def test_prefiller_drop_is_refused_at_once(prefiller, decoder):
    prefiller.call(cmd="drop", transfer_id="t-drop")
    t0 = time.monotonic()
    assert pull(decoder, prefiller.port, "r-drop", "t-drop", [1]) is False
    assert time.monotonic() - t0 < 0.9


def test_malformed_messages_get_error_replies_and_channel_survives(prefiller, decoder):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"tcp://127.0.0.1:{prefiller.port}")
    try:
        for garbage in (b"", b"\x00\xff garbage", encode_reply_as_pull()):
            sock.send(garbage)
            reply = decode_reply(sock.recv())
            assert reply.ok is False and reply.transfer_id == "" and reply.error
    finally:
        sock.close()
    assert prefiller.call(cmd="results")["malformed"] >= 3
    prefiller.call(cmd="hold", transfer_id="t-after", block_ids=[1])
    assert pull(decoder, prefiller.port, "r-after", "t-after", [63])
    assert_copied(prefiller, decoder, [1], [63])


def encode_reply_as_pull() -> bytes:
    from connector.wire import PullReply

    return encode(PullReply(1, "x", ok=True))


def test_wrong_region_layout_is_refused_and_blocks_freed(prefiller):
    """A decoder whose KV layout differs (e.g. another model) must not receive anything."""
    settings = ConnectorSettings.load(
        {"protocol": "tcp", "host": "127.0.0.1", "pull_timeout_s": 3}, env={}
    )
    w = P2pWorker(settings, "decode-other", CFG["num_blocks"], 0, free_port(), False, True)
    _, caches = make_caches({**CFG, "layers": 2}, seed=None)
    w.register_kv_caches(caches)
    try:
        prefiller.call(cmd="hold", transfer_id="t-layout", block_ids=[1])
        assert pull((w, None, None), prefiller.port, "r-layout", "t-layout", [1]) is False
        assert not any(block_bytes(caches, 0, 1))
    finally:
        w.shutdown()
    res = prefiller.call(cmd="results")
    assert "t-layout" in res["finished_sending"] and res["counts"]["failed"] >= 1


def test_dead_prefiller_fails_within_timeout(decoder):
    t0 = time.monotonic()
    assert pull(decoder, free_port(), "r-dead", "t-dead", [1, 2]) is False
    assert time.monotonic() - t0 < 6  # pull_timeout_s = 3


def test_killed_prefiller_fails_its_pulls_at_once():
    """The decoder sees the side channel close and fails pulls in flight in about a second,
    instead of waiting out its pull timeout (issue 11: 25 s before)."""
    import signal

    settings = ConnectorSettings.load(
        {"protocol": "tcp", "host": "127.0.0.1", "pull_timeout_s": 30}, env={}
    )
    w = P2pWorker(settings, "decode-kill", CFG["num_blocks"], 0, free_port(), False, True)
    _, caches = make_caches(CFG, seed=None)
    w.register_kv_caches(caches)
    p = Prefiller(ready_timeout_s=30)
    try:
        p.call(cmd="expect", transfer_id="t-kill")  # the pull parks: no answer is coming
        task = RecvTask("r-kill", "t-kill", "k", [[3, 4]], "127.0.0.1", p.port)
        w.start_load_kv(P2pMetadata(recv=[task]))
        time.sleep(0.5)
        t0 = time.monotonic()
        p.proc.send_signal(signal.SIGKILL)
        p.proc.wait(10)
        failed: set[str] = set()
        while "r-kill" not in failed and time.monotonic() - t0 < 10:
            _, _, f = w.get_transfer_results()
            failed |= f
            time.sleep(0.02)
        took = time.monotonic() - t0
        print(f"\nkilled prefiller detected, pull failed after {took:.2f}s (pull timeout 30 s)")
        assert "r-kill" in failed and took < 3
        # A pull sent after the death (the case: killed after handing out a
        # transfer) finds the connection refused and fails in about DEAD_PEER_S.
        t0 = time.monotonic()
        late = RecvTask("r-after", "t-after", "k", [[5]], "127.0.0.1", p.port)
        w.start_load_kv(P2pMetadata(recv=[late]))
        failed = set()
        while "r-after" not in failed and time.monotonic() - t0 < 10:
            _, _, f = w.get_transfer_results()
            failed |= f
            time.sleep(0.02)
        took = time.monotonic() - t0
        print(f"pull to the dead prefiller failed after {took:.2f}s")
        assert "r-after" in failed and took < 3
    finally:
        p.close()
        w.shutdown()


def test_expiry_frees_blocks_nobody_asked_for(decoder):
    p = Prefiller(expiry_s=1)
    try:
        p.call(cmd="hold", transfer_id="t-exp", block_ids=[1, 2, 3])
        assert p.call(cmd="results")["finished_sending"] == []
        time.sleep(1.3)
        res = p.call(cmd="results")
        assert res["finished_sending"] == ["t-exp"]
        assert res["counts"]["expired"] == 1 and res["held"] == 0
        assert pull(decoder, p.port, "r-exp", "t-exp", [1, 2, 3]) is False
    finally:
        p.close()


def test_large_transfer_is_split_under_the_segment_cap(decoder):
    """More segments than one batch may carry: split into several engine calls."""
    p = Prefiller(max_segments_per_batch=8)
    try:
        src = list(range(2, 42, 2))  # 20 non-contiguous blocks x 3 layers = 60 segments
        dst = list(range(1, 41, 2))
        p.call(cmd="hold", transfer_id="t-big", block_ids=src)
        assert pull(decoder, p.port, "r-big", "t-big", dst)
        assert_copied(p, decoder, src, dst)
    finally:
        p.close()


def test_pull_arriving_after_its_deadline_is_refused_and_freed(prefiller, decoder):
    """A pull delivered late (the decoder already gave up) must never write, and frees at once."""
    from connector.layout import geometry
    from connector.wire import PROTOCOL_VERSION, PullItem, PullRequest

    w, _, caches = decoder
    prefiller.call(cmd="hold", transfer_id="t-late", block_ids=[5, 6])
    late = PullRequest(
        version=PROTOCOL_VERSION,
        msg_id=99,
        decoder_engine_id="decode-test",
        decoder_session=w.transport.session,
        groups=[geometry(g) for g in w.memory.groups],
        deadline_ms=int((time.time() - 1) * 1000),
        items=[PullItem("t-late", "k", [[1, 2]])],
    )
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"tcp://127.0.0.1:{prefiller.port}")
    try:
        sock.send(encode(late))
        reply = decode_reply(sock.recv())
    finally:
        sock.close()
    assert reply.ok is False and reply.transfer_id == "t-late"
    assert "after the decoder's deadline" in reply.error
    assert not any(any(block_bytes(caches, layer, b)) for layer in range(3) for b in (1, 2))
    assert "t-late" in prefiller.call(cmd="results")["finished_sending"]


def test_wrong_secret_cannot_pull_or_release_and_owner_still_can(prefiller, decoder):
    prefiller.call(cmd="hold", transfer_id="t-sec", block_ids=[7, 8], secret="owner-secret")
    assert pull(decoder, prefiller.port, "r-thief", "t-sec", [20, 21], secret="guess") is False
    w = decoder[0]
    thief_release = RecvTask("r-thief2", "t-sec", "", [[]], "127.0.0.1", prefiller.port)
    w.start_load_kv(P2pMetadata(recv=[thief_release]))
    time.sleep(0.5)
    res = prefiller.call(cmd="results")
    assert "t-sec" not in res["finished_sending"] and res["refused_secret"] >= 2
    assert_copied(prefiller, decoder, [], [])  # nothing written for the thief
    assert pull(decoder, prefiller.port, "r-owner", "t-sec", [20, 21], secret="owner-secret")
    assert_copied(prefiller, decoder, [7, 8], [20, 21])


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(frames=st.lists(st.binary(max_size=300), min_size=1, max_size=3))
def test_side_channel_survives_fuzzed_frames(prefiller, frames):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"tcp://127.0.0.1:{prefiller.port}")
    try:
        sock.send_multipart(frames)
        reply = decode_reply(sock.recv())  # every message gets an answer
        assert reply.ok is False
    finally:
        sock.close()


def test_side_channel_still_serves_after_fuzzing(prefiller, decoder):
    prefiller.call(cmd="hold", transfer_id="t-post-fuzz", block_ids=[33])
    assert pull(decoder, prefiller.port, "r-post-fuzz", "t-post-fuzz", [44])
    assert_copied(prefiller, decoder, [33], [44])


async def test_router_release_frees_held_blocks_at_once(prefiller):
    from connector.release import release_remote

    prefiller.call(cmd="hold", transfer_id="t-router", block_ids=[12, 13], secret="s")
    params = {
        "remote_host": "127.0.0.1",
        "remote_port": prefiller.port,
        "transfer_id": "t-router",
        "transfer_secret": "wrong",
    }
    assert await release_remote(params, timeout_s=5) == UNAVAILABLE
    assert await release_remote({**params, "transfer_secret": "s"}, timeout_s=5) is None
    assert "t-router" in prefiller.call(cmd="results")["finished_sending"]
    assert await release_remote({**params, "transfer_secret": "s"}) == UNAVAILABLE
    dead = {**params, "remote_port": free_port()}
    assert "within 0.5s" in await release_remote(dead, timeout_s=0.5)
    assert "incomplete" in await release_remote({"remote_host": "127.0.0.1"})
