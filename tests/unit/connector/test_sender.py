"""The push handler alone, with injectable writers (fakes of the engine call): every
claimed request ends, every refusal path answers at once, nothing waits on a thread."""

from __future__ import annotations

import ctypes
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import torch

from connector.digest import MemoryReader, keyed_digest, written_segments
from connector.layout import GroupLayout, describe_kv_caches, geometry
from connector.plan import RegionLayout
from connector.receiver import check_reply
from connector.recorder import TransferRecorder
from connector.send_registry import UNAVAILABLE, SendRegistry
from connector.sender import InlineExecutor, PushHandler, PushLimits, TpPlace
from connector.wire import PROTOCOL_VERSION, Compat, PullItem, PullReply, PullRequest

GROUP = GroupLayout("full", 32, RegionLayout((4096,), 64, 64, 10))
COMPAT = Compat(PROTOCOL_VERSION, "tiny", "bfloat16", "auto", 2, 2, 32)


def pull(items, session="h:1", deadline_ms=2**62, compat=COMPAT, msg_id=1, groups=None):
    return PullRequest(
        PROTOCOL_VERSION,
        msg_id,
        "d",
        session,
        groups or [geometry(GROUP)],
        deadline_ms,
        items,
        compat=compat,
    )


def handler(reg, write, executor=None, **limits):
    lim = PushLimits(
        ready_timeout_s=limits.pop("ready_timeout_s", 1.0),
        **{"max_segments_per_batch": 100, **limits},
    )
    return PushHandler(
        reg, (GROUP,), write, lim, TransferRecorder(), executor or InlineExecutor(), COMPAT
    )


def test_unexpected_push_error_still_ends_the_request():
    """A bug or surprise inside the push must not strand the claimed request's blocks."""
    reg = SendRegistry(expiry_s=60)
    reg.add("t", [[1, 2]], "k")

    def broken_write(*args):
        raise RuntimeError("engine exploded")

    replies: list[PullReply] = []
    handler(reg, broken_write).accept(pull([PullItem("t", "k", [[3, 4]])]), replies.append)
    (reply,) = replies
    assert not reply.ok and "engine exploded" in reply.error
    assert reg.take_finished() == {"t"}


def test_refusals_answer_at_once_and_uniformly():
    reg = SendRegistry(expiry_s=60)
    reg.add("held", [[1]], "k")
    replies: list[PullReply] = []
    items = [PullItem("never", "k", [[2]]), PullItem("held", "guess", [[2]])]
    t0 = time.monotonic()
    handler(reg, lambda *a: None).accept(pull(items), replies.append)
    assert time.monotonic() - t0 < 0.5
    assert [(r.ok, r.error) for r in replies] == [(False, UNAVAILABLE)] * 2
    assert reg.num_held() == 1 and reg.take_finished() == set()


def test_too_many_items_refuse_the_message():
    reg = SendRegistry(expiry_s=60)
    replies: list[PullReply] = []
    items = [PullItem(f"t{i}", "k", [[1]]) for i in range(5)]
    handler(reg, lambda *a: None, max_items_per_pull=4).accept(pull(items), replies.append)
    (reply,) = replies
    assert reply.transfer_id == "" and "too many items" in reply.error


def test_incompatible_decoder_is_refused_by_name_and_blocks_freed():
    reg = SendRegistry(expiry_s=60)
    reg.add("t", [[1]], "k")
    other = Compat(PROTOCOL_VERSION, "tiny", "float16", "auto", 2, 2, 32)
    replies: list[PullReply] = []
    writes: list[object] = []
    handler(reg, lambda *a: writes.append(a)).accept(
        pull([PullItem("t", "k", [[2]])], compat=other), replies.append
    )
    (reply,) = replies
    assert not reply.ok and "dtype 'bfloat16' here vs 'float16'" in reply.error
    assert writes == [] and reg.take_finished() == {"t"}
    reg.add("u", [[1]], "k")
    replies.clear()
    handler(reg, lambda *a: None).accept(
        pull([PullItem("u", "k", [[2]])], compat=None), replies.append
    )
    assert "no compatibility fingerprint" in replies[0].error


def test_late_pull_is_refused_and_freed_without_writing():
    reg = SendRegistry(expiry_s=60)
    reg.add("t", [[1]], "k")
    writes: list[object] = []
    replies: list[PullReply] = []
    late = int((time.time() - 1) * 1000)
    handler(reg, lambda *a: writes.append(a)).accept(
        pull([PullItem("t", "k", [[2]])], deadline_ms=late), replies.append
    )
    assert "after the decoder's deadline" in replies[0].error
    assert writes == [] and reg.take_finished() == {"t"}


def test_parked_pull_is_served_when_blocks_are_handed_over():
    reg = SendRegistry(expiry_s=60)
    reg.expect("t")
    replies: list[PullReply] = []
    h = handler(reg, lambda *a: None)
    h.accept(pull([PullItem("t", "k", [[2]])]), replies.append)
    assert replies == [] and reg.num_parked() == 1
    reg.add("t", [[1]], "k")  # vLLM's worker thread hands the request over
    assert replies[0].ok and replies[0].written == [[2]]


def test_parked_pull_times_out_on_tick():
    reg = SendRegistry(expiry_s=60)
    reg.expect("t")
    replies: list[PullReply] = []
    h = handler(reg, lambda *a: None, ready_timeout_s=0.05)
    h.accept(pull([PullItem("t", "k", [[2]])]), replies.append)
    time.sleep(0.1)
    h.tick()
    assert [(r.ok, r.error) for r in replies] == [(False, UNAVAILABLE)]


def test_frozen_decoder_holds_one_thread_and_others_are_served():
    """Pushes to one decoder run one at a time; a stuck one never blocks another decoder."""
    reg = SendRegistry(expiry_s=60)
    release = threading.Event()
    in_flight: dict[str, int] = {}
    peak: dict[str, int] = {}
    lock = threading.Lock()

    def write(session, *args):
        with lock:
            in_flight[session] = in_flight.get(session, 0) + 1
            peak[session] = max(peak.get(session, 0), in_flight[session])
        if session == "frozen:1":
            release.wait(5)
        with lock:
            in_flight[session] -= 1

    replies: list[PullReply] = []
    done = threading.Event()

    def respond(r: PullReply) -> None:
        replies.append(r)
        if r.transfer_id == "ok":
            done.set()

    with ThreadPoolExecutor(2) as pool:
        h = handler(reg, write, executor=pool)
        for i in range(3):
            reg.add(f"f{i}", [[1]], "k")
        h.accept(
            pull([PullItem(f"f{i}", "k", [[2]]) for i in range(3)], session="frozen:1"), respond
        )
        reg.add("ok", [[1]], "k")
        h.accept(pull([PullItem("ok", "k", [[2]])], session="healthy:1"), respond)
        assert done.wait(3), "a frozen decoder blocked another decoder's push"
        release.set()
    assert peak["frozen:1"] == 1
    assert sorted(r.transfer_id for r in replies if r.ok) == ["f0", "f1", "f2", "ok"]


def test_push_queue_is_capped_and_overflow_is_freed():
    reg = SendRegistry(expiry_s=60)
    gate = threading.Event()
    replies: list[PullReply] = []
    with ThreadPoolExecutor(1) as pool:
        h = handler(reg, lambda *a: gate.wait(5), executor=pool, max_queued_pushes=1)
        for i in range(3):
            reg.add(f"t{i}", [[1]], "k")
        h.accept(pull([PullItem(f"t{i}", "k", [[2]]) for i in range(3)]), replies.append)
        time.sleep(0.1)
        busy = [r for r in replies if "busy" in r.error]
        gate.set()
    assert len(busy) >= 1
    assert {r.transfer_id for r in busy} <= reg.take_finished() | {"t0", "t1", "t2"}
    assert reg.num_held() == 0


def _fake_engine_write(session, src, dst, lengths):
    """A fake of batch_transfer_sync_write for CPU memory in one process: memcpy."""
    for s, d, n in zip(src, dst, lengths, strict=True):
        ctypes.memmove(d, s, n)


def _caches(seed: int | None):
    gen = torch.Generator().manual_seed(seed or 0)
    t = torch.randint(0, 256, (2 * 10 * 2 * 32 * 64,), dtype=torch.uint8, generator=gen)
    if seed is None:
        t.zero_()
    return {f"l{i}": t[i * 40960 : (i + 1) * 40960].view(10, 2, 32, 64) for i in range(2)}


def _digest_round(tamper: bool) -> str | None:
    src, dst = _caches(7), _caches(None)
    mem_src, mem_dst = describe_kv_caches(src, 10), describe_kv_caches(dst, 10)
    reg = SendRegistry(expiry_s=60)
    reg.add("t", [[1, 2, 5]], "secret")

    def write(session, s, d, n):
        _fake_engine_write(session, s, d, n)
        if tamper:  # someone else writes into the decoder's memory meanwhile
            ctypes.memset(d[0] + 3, 0xAB, 1)

    h = PushHandler(
        reg,
        mem_src.groups,
        write,
        PushLimits(ready_timeout_s=1.0, max_segments_per_batch=100),
        TransferRecorder(),
        InlineExecutor(),
        reader=MemoryReader(src.values()),
    )
    req = PullRequest(
        PROTOCOL_VERSION,
        1,
        "d",
        "h:1",
        [geometry(g) for g in mem_dst.groups],
        2**62,
        [PullItem("t", "secret", [[3, 4, 8]])],
        want_digest=True,
    )
    replies: list[PullReply] = []
    h.accept(req, replies.append)
    (reply,) = replies
    assert reply.ok and len(reply.digest) == 32
    asked = [[3, 4, 8]]
    problem = check_reply(reply, asked, mem_dst.groups)
    if problem:
        return problem
    lay = mem_dst.groups[0].layout
    addrs, lengths = written_segments(
        reply.written, [(lay.base_addrs, lay.block_len, lay.block_stride)]
    )
    got = keyed_digest(MemoryReader(dst.values()), "secret", addrs, lengths)
    return None if got == reply.digest else "digest mismatch"


def test_digest_matches_an_honest_transfer():
    assert _digest_round(tamper=False) is None


def test_digest_catches_a_tampered_byte():
    assert _digest_round(tamper=True) == "digest mismatch"


def test_reply_must_match_what_was_asked():
    mem = describe_kv_caches(_caches(None), 10)
    per_block = mem.groups[0].layout.block_len * 2
    ok = PullReply(1, "t", ok=True, num_bytes=2 * per_block, written=[[3, 4]])
    assert check_reply(ok, [[3, 4]], mem.groups) is None
    extra = PullReply(1, "t", ok=True, num_bytes=3 * per_block, written=[[3, 4, 9]])
    assert "not asked for" in check_reply(extra, [[3, 4]], mem.groups)
    short = PullReply(1, "t", ok=True, num_bytes=per_block, written=[[3, 4]])
    assert "bytes" in check_reply(short, [[3, 4]], mem.groups)
    dup = PullReply(1, "t", ok=True, num_bytes=2 * per_block, written=[[3, 3]])
    assert check_reply(dup, [[3, 4]], mem.groups)


def test_an_unreachable_decoder_fails_its_queued_pushes_at_once():
    """A decoder that vanished mid-push: the engine's write fails after its transfer
    timeout once; the pushes queued behind fail at once instead of each waiting it out."""
    from connector.transport import TransferError

    reg = SendRegistry(expiry_s=60)
    calls: list[str] = []

    def write(session, *args):
        calls.append(session)
        if session == "gone:1":
            time.sleep(0.2)  # the transfer timeout, shortened
            raise TransferError("batch_transfer_sync_write", -1)

    replies: list[PullReply] = []
    for i in range(4):
        reg.add(f"g{i}", [[1]], "k")
    reg.add("ok", [[1]], "k")
    with ThreadPoolExecutor(2) as pool:
        h = handler(reg, write, executor=pool)
        h.accept(
            pull([PullItem(f"g{i}", "k", [[2]]) for i in range(4)], session="gone:1"),
            replies.append,
        )
        deadline = time.monotonic() + 5
        while len(replies) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        h.accept(pull([PullItem("ok", "k", [[2]])], session="gone:1", msg_id=2), replies.append)
        deadline = time.monotonic() + 5
        while len(replies) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    # g0 waited out the timeout; g1-g3 were failed without a write; a later pull is tried.
    assert calls.count("gone:1") == 2
    failed = [r for r in replies if not r.ok]
    assert len(failed) == 5 and all(r.error.startswith("decoder unreachable") for r in failed)
    assert reg.take_finished() == {"g0", "g1", "g2", "g3", "ok"} and reg.num_held() == 0


# -- different TP sizes: each decoder rank gets its own KV heads ----------------------------


def _heads_caches(heads: int, fill: int | None) -> dict[str, torch.Tensor]:
    """CPU-layout KV, [blocks, heads, block_size, 2*head_size], bytes numbered by head."""
    out = {}
    for layer in range(2):
        t = torch.zeros((10, heads, 4, 8), dtype=torch.uint8)
        if fill is not None:
            for b in range(10):
                for h in range(heads):
                    t[b, h] = fill + 100 * layer + 10 * h + b
        out[f"l{layer}"] = t
    return out


def _tp_handler(reg, caches, heads_here, tp_size, tp_rank):
    mem = describe_kv_caches(caches, 10, local_heads=heads_here)
    lim = PushLimits(ready_timeout_s=1.0, max_segments_per_batch=100)
    return PushHandler(
        reg,
        mem.groups,
        _fake_engine_write,
        lim,
        TransferRecorder(),
        InlineExecutor(),
        COMPAT,
        tp=TpPlace(2, tp_size, tp_rank),
    )


def _tp_pull(dst_caches, heads_here, tp_size, tp_rank, ids):
    mem = describe_kv_caches(dst_caches, 10, local_heads=heads_here)
    return PullRequest(
        PROTOCOL_VERSION,
        1,
        "d",
        f"d{tp_rank}:1",
        [geometry(g) for g in mem.groups],
        2**62,
        [PullItem("t", "k", ids)],
        compat=COMPAT,
        tp_size=tp_size,
        tp_rank=tp_rank,
    )


def test_prefill_tp1_feeds_two_decoder_ranks_their_own_heads():
    reg = SendRegistry(expiry_s=60)
    reg.add("t", [[1, 2]], "k")
    src = _heads_caches(2, fill=1)
    h = _tp_handler(reg, src, 2, 1, 0)
    dst = [_heads_caches(1, fill=None) for _ in range(2)]
    replies: list[PullReply] = []
    h.accept(_tp_pull(dst[0], 1, 2, 0, [[5, 6]]), replies.append)
    assert replies[-1].ok and reg.take_finished() == set()  # rank 1 still to come
    h.accept(_tp_pull(dst[1], 1, 2, 1, [[7, 8]]), replies.append)
    assert replies[-1].ok and reg.take_finished() == {"t"}
    for rank, slots in ((0, (5, 6)), (1, (7, 8))):
        for layer in ("l0", "l1"):
            for s_blk, d_blk in zip((1, 2), slots, strict=True):
                assert torch.equal(dst[rank][layer][d_blk, 0], src[layer][s_blk, rank])
    assert replies[0].num_bytes == 2 * 2 * 32  # 2 blocks x 2 layers x one head's 32 B


def test_two_prefill_ranks_fill_one_decoder_rank():
    dst = _heads_caches(2, fill=None)
    srcs = [_heads_caches(1, fill=10 * (r + 1)) for r in range(2)]
    for rank in range(2):
        reg = SendRegistry(expiry_s=60)
        reg.add("t", [[3]], "k")
        replies: list[PullReply] = []
        _tp_handler(reg, srcs[rank], 1, 2, rank).accept(
            _tp_pull(dst, 2, 1, 0, [[9]]), replies.append
        )
        assert replies[-1].ok and reg.take_finished() == {"t"}
    for layer in ("l0", "l1"):
        for rank in range(2):
            assert torch.equal(dst[layer][9, rank], srcs[rank][layer][3, 0])


def test_a_decoder_rank_asking_the_wrong_prefill_rank_is_refused_by_name():
    reg = SendRegistry(expiry_s=60)
    reg.add("t", [[3]], "k")
    replies: list[PullReply] = []
    # P TP=2 rank 1 holds head 1; D TP=4 rank 0 holds head 0 (replicated): not from here.
    h = _tp_handler(reg, _heads_caches(1, fill=1), 1, 2, 1)
    h.accept(_tp_pull(_heads_caches(1, None), 1, 4, 0, [[4]]), replies.append)
    (reply,) = replies
    assert not reply.ok and "needs none of the KV heads" in reply.error
    # Equal TP sizes pair rank with rank.
    reg.add("u", [[3]], "k")
    req = _tp_pull(_heads_caches(1, None), 1, 2, 0, [[4]])
    h.accept(msgspec.structs.replace(req, items=[PullItem("u", "k", [[4]])]), replies.append)
    assert not replies[-1].ok and "pulled from prefiller rank 1" in replies[-1].error


def test_blocks_behind_a_failed_engine_write_are_held_not_freed_at_once():
    from connector.transport import TransferError

    reg = SendRegistry(expiry_s=60)
    reg.add("t", [[1]], "k")

    def fail(*args):
        raise TransferError("batch_transfer_sync_write", -1)

    replies: list[PullReply] = []
    h = handler(reg, fail, failed_push_hold_s=30)
    h.accept(pull([PullItem("t", "k", [[2]])]), replies.append)
    (reply,) = replies
    assert not reply.ok and reply.error.startswith("decoder unreachable")
    assert reg.take_finished() == set() and reg.num_held() == 1  # held for the engine
    reg.add("u", [[1]], "k")
    h2 = handler(reg, lambda *a: (_ for _ in ()).throw(ValueError("bad plan")))
    h2.accept(pull([PullItem("u", "k", [[2]])]), replies.append)
    assert reg.take_finished() == {"u"}  # nothing reached the engine: freed at once
