"""The scheduler-side state machine, driven with real vLLM Request and KVCacheBlocks objects."""

from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request, RequestStatus

from connector.scheduler import P2pMetadata, P2pScheduler

REMOTE = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "P",
    "remote_host": "127.0.0.1",
    "remote_port": 17100,
    "transfer_id": "cmpl-abc-0",
}


def request(rid: str, n_prompt: int, params: dict | None) -> Request:
    sp = SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": params} if params else None)
    return Request(rid, list(range(1, n_prompt + 1)), sp, None)


def blocks(*ids: int, hashed: int = 0) -> KVCacheBlocks:
    out = []
    for i, b in enumerate(ids):
        blk = KVCacheBlock(b)
        if i < hashed:
            blk._block_hash = b"h" + bytes([i])  # type: ignore[assignment]
        out.append(blk)
    return KVCacheBlocks((out,))


def producer() -> P2pScheduler:
    return P2pScheduler("P", "127.0.0.1", 17100, can_produce=True, can_consume=False)


def consumer() -> P2pScheduler:
    return P2pScheduler("D", "127.0.0.1", 17100, can_produce=False, can_consume=True)


def test_prefiller_holds_blocks_and_returns_handle():
    s = producer()
    req = request("p1", 70, {"do_remote_decode": True, "do_remote_prefill": False})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = s.request_finished(req, [4, 5, 6])
    assert delay is True
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "P",
        "remote_host": "127.0.0.1",
        "remote_port": 17100,
        "transfer_id": "p1",
        "remote_num_blocks": 3,
    }
    meta = s.build_connector_meta()
    assert meta.send == {"p1": [4, 5, 6]}
    assert s.build_connector_meta() == P2pMetadata()  # drained


def test_prefill_that_stopped_early_hands_nothing_over():
    s = producer()
    req = request("p2", 10, {"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_STOPPED  # e.g. its one token was EOS
    assert s.request_finished(req, [1]) == (False, None)
    assert s.build_connector_meta().dropped == ["p2"]
    assert s.num_not_handed_over == 1


def test_plain_request_is_untouched():
    s = producer()
    req = request("p3", 10, None)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.request_finished(req, [1]) == (False, None)
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
    assert task.block_ids == [10, 11]
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
    assert task.block_ids == []


def test_abort_before_allocation_releases_prefiller():
    s = consumer()
    req = request("d4", 64, dict(REMOTE))
    req.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(req, []) == (False, None)
    (task,) = s.build_connector_meta().recv
    assert task.block_ids == [] and task.transfer_id == "cmpl-abc-0"
    # finished after allocation: nothing more to do
    req2 = request("d5", 64, dict(REMOTE))
    s.update_state_after_alloc(req2, blocks(3), 64)
    s.build_connector_meta()
    assert s.request_finished(req2, [3]) == (False, None)
    assert s.build_connector_meta().recv == []


def test_incomplete_params_compute_locally():
    s = consumer()
    for bad in (
        {"do_remote_prefill": True},
        {**REMOTE, "remote_port": "17100"},
        {**REMOTE, "remote_port": 0},
        {**REMOTE, "transfer_id": ""},
        {**REMOTE, "remote_host": None},
    ):
        req = request("bad", 40, bad)
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
        s.update_state_after_alloc(req, blocks(1, 2), 0)
    assert s.build_connector_meta().recv == []


def test_producer_ignores_remote_prefill_params():
    s = producer()
    req = request("x", 40, dict(REMOTE))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
