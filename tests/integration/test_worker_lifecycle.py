"""Decoder batching per prefiller, and a clean, prompt shutdown with work in flight."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq

from connector.layout import GroupLayout
from connector.plan import RegionLayout
from connector.receiver import PullClient, PullSpec
from connector.recorder import TransferRecorder
from connector.scheduler import P2pMetadata, RecvTask
from connector.settings import ConnectorSettings
from connector.wire import PullReply, decode_pull, encode
from connector.worker import P2pWorker
from tests.servers import free_port

pytestmark = pytest.mark.integration


def test_requests_to_one_prefiller_in_one_step_share_one_message():
    """FAKE prefiller side channel: a bare ROUTER that counts messages and answers ok."""
    port = free_port()
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    group = GroupLayout("full", 32, RegionLayout((4096,), 64, 64, 10))
    settings = ConnectorSettings.load({"pull_timeout_s": 5.0}, env={})
    client = PullClient("dec", "127.0.0.1:1", (group,), settings, TransferRecorder())
    client.start()
    try:
        peer = f"tcp://127.0.0.1:{port}"
        client.submit([PullSpec(f"r{i}", f"t{i}", "k", [[i + 1]], peer) for i in range(3)])
        assert router.poll(5000)
        ident, payload = router.recv_multipart()
        msg = decode_pull(payload)
        assert [i.transfer_id for i in msg.items] == ["t0", "t1", "t2"]
        assert not router.poll(300)  # one message for all three
        for item in msg.items:
            ok = PullReply(
                msg.msg_id, item.transfer_id, ok=True, num_bytes=64, written=item.block_ids
            )
            router.send_multipart([ident, encode(ok)])
        deadline = time.monotonic() + 5
        done: set[str] = set()
        while len(done) < 3 and time.monotonic() < deadline:
            d, failed = client.take_results()
            assert not failed
            done |= d
            time.sleep(0.01)
        assert done == {"r0", "r1", "r2"}
    finally:
        client.close()
        router.close()


def test_shutdown_is_prompt_and_joins_every_thread():
    settings = ConnectorSettings.load(
        {"protocol": "tcp", "host": "127.0.0.1", "ready_timeout_s": 30, "pull_timeout_s": 30},
        env={},
    )
    port = free_port()
    w = P2pWorker(settings, "both", 16, 0, port, True, True)
    caches = {"l0": torch.zeros(16, 2, 32, 64, dtype=torch.bfloat16)}
    w.register_kv_caches(caches)
    # A pull that will wait (announced, never handed over, 30 s ready timeout) is parked
    # at shutdown.
    w.start_load_kv(P2pMetadata(expected=["never"]))
    w.start_load_kv(P2pMetadata(recv=[RecvTask("r", "never", "k", [[3]], "127.0.0.1", port)]))
    time.sleep(0.5)
    t0 = time.monotonic()
    w.shutdown()
    assert time.monotonic() - t0 < 8
    time.sleep(0.2)
    left = [t.name for t in threading.enumerate() if t.name.startswith("pd-kv")]
    assert left == []
