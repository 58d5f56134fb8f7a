"""A prefiller worker in its own process for integration tests (real engine, real socket).

Reads JSON commands on stdin, answers JSON lines on stdout:
  {"cmd": "hold", "transfer_id": ..., "block_ids": [...], "secret": ...}   as vLLM would
  {"cmd": "expect", "transfer_id": ...}                     the scheduler admitted it
  {"cmd": "drop", "transfer_id": ...}                       the request ended without KV
  {"cmd": "results"}                                        what vLLM's step would collect
  {"cmd": "quit"}
"""

from __future__ import annotations

import json
import sys

from connector.scheduler import P2pMetadata, SendTask
from connector.settings import ConnectorSettings
from connector.wire import Compat
from connector.worker import P2pWorker
from tests.integration.kvbuf import make_caches


def say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def main() -> None:
    cfg = json.loads(sys.argv[1])
    settings = ConnectorSettings.load(
        {
            "protocol": "tcp",
            "host": "127.0.0.1",
            "side_channel_port": cfg["port"],
            "expiry_s": cfg.get("expiry_s", 60),
            "ready_timeout_s": cfg.get("ready_timeout_s", 1),
            "max_segments_per_batch": cfg.get("max_segments_per_batch", 1000),
            "max_message_bytes": cfg.get("max_message_bytes", 16 << 20),
            # Tests here watch blocks freed right after a failed push; the hold itself
            # (failed_push_hold_s) is covered in tests/unit/connector.
            "failed_push_hold_s": cfg.get("failed_push_hold_s", 0),
        },
        env={},
    )
    compat = Compat(**cfg["compat"]) if "compat" in cfg else None
    worker = P2pWorker(
        settings,
        "prefill-test",
        cfg["num_blocks"],
        cfg.get("tp_rank", 0),
        cfg["port"],
        True,
        False,
        compat=compat,
        tp_size=cfg.get("tp_size", 1),
    )
    _, caches = make_caches(cfg, seed=cfg["seed"])
    worker.register_kv_caches(caches)
    say({"event": "ready"})
    refused = 0  # pulls refused so far, from the stats vLLM would collect each step
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "hold":
            task = SendTask([cmd["block_ids"]], cmd.get("secret", "k"))
            worker.start_load_kv(P2pMetadata(send={cmd["transfer_id"]: task}))
            say({"ok": True})
        elif cmd["cmd"] == "expect":
            worker.start_load_kv(P2pMetadata(expected=[cmd["transfer_id"]]))
            say({"ok": True})
        elif cmd["cmd"] == "drop":
            worker.start_load_kv(P2pMetadata(dropped=[cmd["transfer_id"]]))
            say({"ok": True})
        elif cmd["cmd"] == "results":
            sending, _, _ = worker.get_transfer_results()
            refused += len((worker.take_stats() or {}).get("refused", []))
            counts = {k.value: v for k, v in worker.registry.counts.items()}
            say(
                {
                    "finished_sending": sorted(sending),
                    "counts": counts,
                    "held": worker.registry.num_held(),
                    "malformed": worker._server.malformed,
                    "refused_secret": worker.registry.refused_secret,
                    "parked": worker.registry.num_parked(),
                    "refused": refused,
                    "rss_kib": rss_kib(),
                }
            )
        elif cmd["cmd"] == "quit":
            break
    worker.shutdown()
    say({"event": "bye"})


if __name__ == "__main__":
    main()
