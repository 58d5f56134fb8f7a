"""Prefill and decode at different TP sizes: real Mooncake engines over TCP, one process per
rank, every head's bytes checked where it lands."""

from __future__ import annotations

import time

import pytest

from connector.scheduler import P2pMetadata, RecvTask
from connector.settings import ConnectorSettings
from connector.wire import PROTOCOL_VERSION, Compat
from connector.worker import P2pWorker
from tests.integration.kvbuf import head_bytes, make_caches
from tests.integration.proc import WorkerProc
from tests.servers import free_port

pytestmark = pytest.mark.integration

TOTAL_HEADS = 2
COMPAT = {
    "protocol": PROTOCOL_VERSION,
    "model": "tiny",
    "dtype": "bfloat16",
    "kv_cache_dtype": "auto",
    "num_layers": 2,
    "total_kv_heads": TOTAL_HEADS,
    "head_size": 32,
}
BASE = {"num_blocks": 32, "layers": 2, "block_size": 32, "head": 32, "compat": COMPAT}


def prefill_ranks(tp: int, port: int) -> list[WorkerProc]:
    heads = max(1, TOTAL_HEADS // tp)
    return [
        WorkerProc(
            "prefiller_proc",
            {**BASE, "heads": heads, "port": port + r, "tp_size": tp, "tp_rank": r, "seed": 7 + r},
        )
        for r in range(tp)
    ]


def p_head(p: WorkerProc, layer: int, block: int, head: int) -> bytes:
    _, caches = make_caches(p.cfg, seed=p.cfg["seed"])
    return head_bytes(caches, layer, block, head)


def wait_sent(p: WorkerProc, tid: str, timeout: float = 15) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = p.call(cmd="results")
        if tid in res["finished_sending"]:
            return res
        time.sleep(0.05)
    raise AssertionError(f"{tid} never ended on the prefiller")


def test_prefill_tp2_to_decode_tp1_assembles_each_block_from_both_ranks():
    port = free_port()
    ps = prefill_ranks(2, port)
    settings = ConnectorSettings.load(
        {"protocol": "tcp", "host": "127.0.0.1", "pull_timeout_s": 10}, env={}
    )
    d = P2pWorker(
        settings, "d", BASE["num_blocks"], 0, free_port(), False, True, compat=Compat(**COMPAT)
    )
    _, caches = make_caches({**BASE, "heads": 2}, seed=None)
    try:
        d.register_kv_caches(caches)
        for p in ps:
            p.call(cmd="hold", transfer_id="t", block_ids=[3, 4, 5], secret="k")
        task = RecvTask("r", "t", "k", [[20, 21, 9]], "127.0.0.1", port, remote_tp_size=2)
        d.start_load_kv(P2pMetadata(recv=[task]))
        deadline = time.monotonic() + 15
        done: set[str] = set()
        failed: set[str] = set()
        while "r" not in done and time.monotonic() < deadline:
            _, dn, fl = d.get_transfer_results()
            done |= dn
            failed |= fl
            time.sleep(0.02)
        assert "r" in done and not failed
        for rank, p in enumerate(ps):
            assert wait_sent(p, "t")["held"] == 0
            for layer in range(2):
                for s, dst in zip((3, 4, 5), (20, 21, 9), strict=True):
                    assert head_bytes(caches, layer, dst, rank) == p_head(p, layer, s, 0)
        untouched = [b for b in range(BASE["num_blocks"]) if b not in (20, 21, 9)]
        for b in untouched:  # nothing outside the asked blocks was written
            assert not any(head_bytes(caches, 0, b, 0) + head_bytes(caches, 0, b, 1))
    finally:
        d.shutdown()
        for p in ps:
            p.close()


def test_prefill_tp1_to_decode_tp2_each_rank_gets_its_head_and_p_frees_after_both():
    port = free_port()
    (p,) = prefill_ranks(1, port)
    ds = [
        WorkerProc(
            "decoder_proc", {**BASE, "heads": 1, "tp_size": 2, "tp_rank": r, "pull_timeout_s": 10}
        )
        for r in range(2)
    ]
    try:
        p.call(cmd="hold", transfer_id="t", block_ids=[6, 7], secret="k")
        pull = {"cmd": "pull", "transfer_id": "t", "port": port, "remote_tp_size": 1}
        ds[0].call(**pull, request_id="r", block_ids=[1, 2])
        deadline = time.monotonic() + 15
        while "r" not in ds[0].call(cmd="results")["done"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "t" not in p.call(cmd="results")["finished_sending"]  # rank 1 still to pull
        ds[1].call(**pull, request_id="r", block_ids=[11, 12])
        res = wait_sent(p, "t")
        assert res["counts"]["sent"] == 1 and res["held"] == 0
        for rank, (dp, slots) in enumerate(zip(ds, ([1, 2], [11, 12]), strict=True)):
            assert "r" not in dp.call(cmd="results")["failed"]
            for s, dst in zip((6, 7), slots, strict=True):
                got = dp.call(cmd="heads", block=dst)["heads"]
                for layer in range(2):
                    assert bytes.fromhex(got[layer][0]) == p_head(p, layer, s, rank)
    finally:
        for x in (*ds, p):
            x.close()


@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1)])
def test_an_aborted_request_releases_every_prefill_rank_once(p_tp, d_tp):
    port = free_port()
    ps = prefill_ranks(p_tp, port)
    heads = TOTAL_HEADS // d_tp
    ds = [
        WorkerProc("decoder_proc", {**BASE, "heads": heads, "tp_size": d_tp, "tp_rank": r})
        for r in range(d_tp)
    ]
    try:
        for p in ps:
            p.call(cmd="hold", transfer_id="t", block_ids=[6], secret="k")
        for dp in ds:  # every decoder rank sees the abort; one releases each prefill rank
            dp.call(
                cmd="pull",
                request_id="r",
                transfer_id="t",
                block_ids=[],
                port=port,
                remote_tp_size=p_tp,
            )
        for p in ps:
            res = wait_sent(p, "t")
            assert res["counts"]["released"] == 1 and res["held"] == 0
            assert res["refused"] == 0  # no second release for an ended request
    finally:
        for x in (*ds, *ps):
            x.close()
