"""The scheduler-side state machine, driven with real vLLM Request and KVCacheBlocks objects."""

from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request, RequestStatus

from connector.groups import GroupSpec
from connector.scheduler import P2pMetadata, P2pScheduler, SendTask

REMOTE = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "P",
    "remote_host": "127.0.0.1",
    "remote_port": 17100,
    "transfer_id": "cmpl-abc-0",
    "transfer_secret": "s3cret",
}
ONE_GROUP = (GroupSpec("full", 32, ("l0", "l1")),)
HYBRID = (GroupSpec("sliding:64", 32, ("l0", "l2")), GroupSpec("full", 32, ("l1", "l3")))


def request(rid: str, n_prompt: int, params: dict | None) -> Request:
    sp = SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": params} if params else None)
    return Request(rid, list(range(1, n_prompt + 1)), sp, None)


def group(ids, hashed: int = 0) -> list[KVCacheBlock]:
    out = []
    for i, b in enumerate(ids):
        blk = KVCacheBlock(b, is_null=b == 0)
        if i < hashed and b:
            blk._block_hash = b"h" + bytes([i])  # type: ignore[assignment]
        out.append(blk)
    return out


def blocks(*ids: int, hashed: int = 0) -> KVCacheBlocks:
    return KVCacheBlocks((group(ids, hashed),))


def producer(groups=ONE_GROUP) -> P2pScheduler:
    return P2pScheduler("P", "127.0.0.1", 17100, True, False, groups, tuple(range(len(groups))))


def consumer(groups=ONE_GROUP) -> P2pScheduler:
    return P2pScheduler("D", "127.0.0.1", 17100, False, True, groups, tuple(range(len(groups))))


def test_prefiller_holds_blocks_and_returns_handle():
    s = producer()
    req = request("p1", 70, {"do_remote_decode": True, "do_remote_prefill": False})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = s.request_finished(req, ([4, 5, 6],))
    assert delay is True
    secret = params.pop("transfer_secret")
    assert len(secret) >= 24
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "P",
        "remote_host": "127.0.0.1",
        "remote_port": 17100,
        "transfer_id": "p1",
        "remote_num_blocks": [3],
        "remote_tp_size": 1,
    }
    meta = s.build_connector_meta()
    assert meta.send == {"p1": SendTask([[4, 5, 6]], secret)}
    assert s.build_connector_meta() == P2pMetadata()  # drained


def test_prefill_that_stopped_early_hands_nothing_over():
    s = producer()
    req = request("p2", 10, {"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_STOPPED  # e.g. its one token was EOS
    assert s.request_finished(req, ([1],)) == (False, None)
    assert s.build_connector_meta().dropped == ["p2"]
    assert s.num_not_handed_over == 1


def test_plain_request_is_untouched():
    s = producer()
    req = request("p3", 10, None)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.request_finished(req, ([1],)) == (False, None)
    assert s.build_connector_meta() == P2pMetadata()


def test_decoder_loads_all_prompt_tokens_async():
    s = consumer()
    req = request("d1", 70, dict(REMOTE))
    assert s.get_num_new_matched_tokens(req, 0) == (70, True)
    # with a local prefix hit of 32 tokens, only the rest is loaded
    assert s.get_num_new_matched_tokens(req, 32) == (38, True)


def test_decoder_records_only_unhashed_blocks_and_pulls_once():
    s = consumer()
    req = request("d2", 70, dict(REMOTE))
    s.update_state_after_alloc(req, blocks(9, 10, 11, hashed=1), num_external_tokens=38)
    meta = s.build_connector_meta()
    assert len(meta.recv) == 1
    task = meta.recv[0]
    assert task.block_ids == [[10, 11]]
    assert task.secret == "s3cret"
    assert (task.transfer_id, task.remote_host, task.remote_port) == (
        "cmpl-abc-0",
        "127.0.0.1",
        17100,
    )
    # The flag is consumed: a preempted and rescheduled request does not pull again.
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, blocks(12), 0)
    assert s.build_connector_meta().recv == []


def test_full_local_hit_still_releases_prefiller():
    s = consumer()
    req = request("d3", 64, dict(REMOTE))
    s.update_state_after_alloc(req, blocks(1, 2, hashed=2), num_external_tokens=0)
    (task,) = s.build_connector_meta().recv
    assert task.block_ids == [[]]


def test_abort_before_allocation_releases_prefiller():
    s = consumer()
    req = request("d4", 64, dict(REMOTE))
    req.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(req, ([],)) == (False, None)
    (task,) = s.build_connector_meta().recv
    assert task.block_ids == [[]] and task.transfer_id == "cmpl-abc-0"
    # finished after allocation: nothing more to do
    req2 = request("d5", 64, dict(REMOTE))
    s.update_state_after_alloc(req2, blocks(3), 64)
    s.build_connector_meta()
    assert s.request_finished(req2, ([3],)) == (False, None)
    assert s.build_connector_meta().recv == []


def test_incomplete_params_compute_locally():
    s = consumer()
    for bad in (
        {"do_remote_prefill": True},
        {**REMOTE, "remote_port": "17100"},
        {**REMOTE, "remote_port": 0},
        {**REMOTE, "transfer_id": ""},
        {**REMOTE, "remote_host": None},
        {k: v for k, v in REMOTE.items() if k != "transfer_secret"},
        {**REMOTE, "remote_tp_size": 0},
        {**REMOTE, "remote_tp_size": "2"},
        {**REMOTE, "remote_tp_size": True},
        {**REMOTE, "remote_port": 65535, "remote_tp_size": 2},  # rank 1 past the last port
    ):
        req = request("bad", 40, bad)
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
        s.update_state_after_alloc(req, blocks(1, 2), 0)
    assert s.build_connector_meta().recv == []


def test_producer_ignores_remote_prefill_params():
    s = producer()
    req = request("x", 40, dict(REMOTE))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)


def test_hybrid_prefiller_holds_every_group_with_null_slots():
    s = producer(HYBRID)
    req = request("h1", 200, {"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    # 200 tokens = 7 slots; the sliding group's out-of-window slots are the null block 0.
    sliding, full = [0, 0, 0, 0, 21, 22, 23], [1, 2, 3, 4, 5, 6, 7]
    delay, params = s.request_finished(req, (sliding, full))
    assert delay and params["remote_num_blocks"] == [3, 7]
    assert s.build_connector_meta().send["h1"].block_ids == [sliding, full]


def test_hybrid_decoder_asks_positionally_after_its_local_prefix():
    s = consumer(HYBRID)
    req = request("h2", 200, dict(REMOTE))
    # A local hit of 64 tokens (2 slots): the decoder needs slots 2..6 of each group, nulls kept.
    kv = KVCacheBlocks(
        (group([0, 31, 0, 0, 34, 35, 36], hashed=2), group([40, 41, 42, 43, 44, 45, 46], hashed=2))
    )
    s.update_state_after_alloc(req, kv, num_external_tokens=200 - 64)
    (task,) = s.build_connector_meta().recv
    assert task.block_ids == [[0, 0, 34, 35, 36], [42, 43, 44, 45, 46]]


def test_only_transfer_groups_are_used():
    s = P2pScheduler("P", "h", 1, True, False, ONE_GROUP, (1,))  # group 0 does not transfer
    req = request("t", 40, {"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.request_finished(req, ([9, 9], [4, 5]))[0]
    assert s.build_connector_meta().send["t"].block_ids == [[4, 5]]


def test_empty_steps_are_paced_only_while_a_transfer_is_outstanding():
    import time

    s = P2pScheduler("P", "h", 1, True, False, ONE_GROUP, (0,), idle_wait_s=0.05)

    def timed(idle: bool) -> float:
        t0 = time.monotonic()
        s.build_connector_meta(idle)
        return time.monotonic() - t0

    assert timed(True) < 0.02  # nothing outstanding: no pacing
    req = request("p", 40, {"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    s.request_finished(req, ([1, 2],))
    assert timed(True) < 0.02  # this step hands the request over: never delayed
    assert timed(True) >= 0.045  # held and nothing to run: paced
    assert timed(False) < 0.02  # a step with work is never delayed
    s.update_connector_output({"p"}, set())
    assert timed(True) < 0.02  # freed: no more pacing


# --- hostile kv_transfer_params (vLLM copies them from client fields without a type check) ---

HOSTILE = [
    "do_remote_prefill",
    ["do_remote_prefill", True],
    42,
    {"do_remote_prefill": "yes", **{k: v for k, v in REMOTE.items() if k != "do_remote_prefill"}},
    {**REMOTE, "remote_port": True},
    {**REMOTE, "transfer_id": ["x"]},
    {**REMOTE, "transfer_secret": {"a": 1}},
    {**REMOTE, "remote_host": "h" * 300},
    {"do_remote_decode": "true"},
]


def test_hostile_params_never_raise_and_are_served_locally(caplog):
    for role in (consumer(), producer()):
        for i, params in enumerate(HOSTILE):
            req = request(f"h{i}", 70, {"x": 1})
            req.kv_transfer_params = params  # what vLLM does with vllm_xargs
            assert role.get_num_new_matched_tokens(req, 0) == (0, False)
            role.update_state_after_alloc(req, blocks(1, 2, 3), 0)
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            assert role.request_finished(req, ([1, 2, 3],)) == (False, None)
        meta = role.build_connector_meta()
        assert meta.recv == [] and meta.send == {} and meta.expected == []
    assert consumer().num_bad_params == 0


def test_malformed_params_are_counted_and_logged_escaped_without_secrets(caplog):
    s = consumer()
    req = request("evil\nFORGED LINE \x1b[31m", 70, {"x": 1})
    req.kv_transfer_params = "not a dict"
    s.get_num_new_matched_tokens(req, 0)
    s.get_num_new_matched_tokens(req, 0)  # scheduled again: warned once
    assert s.num_bad_params == 1
    partial = request("p", 70, {**REMOTE, "remote_port": "17100"})
    s.update_state_after_alloc(partial, blocks(1, 2, 3), 64)
    assert s.num_bad_params == 2
    text = caplog.text
    assert "\nFORGED" not in text and "\x1b" not in text
    assert "s3cret" not in text and "<redacted>" in text


def test_producer_announces_expected_requests_once():
    s = producer()
    req = request("p9", 70, {"do_remote_decode": True})
    s.get_num_new_matched_tokens(req, 0)
    s.get_num_new_matched_tokens(req, 0)
    assert s.build_connector_meta().expected == ["p9"]
    assert s.build_connector_meta().expected == []


def test_decoder_learns_the_prefillers_tp_size():
    s = consumer()
    req = request("d-tp", 40, {**REMOTE, "remote_tp_size": 4})
    assert s.get_num_new_matched_tokens(req, 0) == (40, True)
    s.update_state_after_alloc(req, blocks(1, 2), 40)
    (task,) = s.build_connector_meta().recv
    assert (task.remote_port, task.remote_tp_size) == (17100, 4)
