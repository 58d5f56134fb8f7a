"""A decoder worker in its own process for integration tests (so a test can freeze it).

Reads JSON commands on stdin, answers JSON lines on stdout:
  {"cmd": "pull", "request_id", "transfer_id", "block_ids", "port", "secret"}
  {"cmd": "results"}    finished / failed request ids so far
  {"cmd": "heads", "block": b}   per layer, the hex of each head's bytes in block b
  {"cmd": "quit"}
"""

from __future__ import annotations

import json
import sys

from connector.scheduler import P2pMetadata, RecvTask
from connector.settings import ConnectorSettings
from connector.wire import Compat
from connector.worker import P2pWorker
from tests.integration.kvbuf import head_bytes, make_caches
from tests.servers import free_port


def say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    settings = ConnectorSettings.load(
        {"protocol": "tcp", "host": "127.0.0.1", "pull_timeout_s": cfg.get("pull_timeout_s", 30)},
        env={},
    )
    compat = Compat(**cfg["compat"]) if "compat" in cfg else None
    worker = P2pWorker(
        settings,
        "decode-proc",
        cfg["num_blocks"],
        cfg.get("tp_rank", 0),
        free_port(),
        False,
        True,
        compat=compat,
        tp_size=cfg.get("tp_size", 1),
    )
    _, caches = make_caches(cfg, seed=None)
    worker.register_kv_caches(caches)
    done: set[str] = set()
    failed: set[str] = set()
    say({"event": "ready"})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "pull":
            task = RecvTask(
                cmd["request_id"],
                cmd["transfer_id"],
                cmd.get("secret", "k"),
                [cmd["block_ids"]],
                "127.0.0.1",
                cmd["port"],
                cmd.get("remote_tp_size", 1),
            )
            worker.start_load_kv(P2pMetadata(recv=[task]))
            say({"ok": True})
        elif cmd["cmd"] == "results":
            _, d, f = worker.get_transfer_results()
            done |= d
            failed |= f
            say({"done": sorted(done), "failed": sorted(failed)})
        elif cmd["cmd"] == "heads":
            say(
                {
                    "heads": [
                        [
                            head_bytes(caches, layer, cmd["block"], h).hex()
                            for h in range(cfg["heads"])
                        ]
                        for layer in range(cfg["layers"])
                    ]
                }
            )
        elif cmd["cmd"] == "quit":
            break
    worker.shutdown()
    say({"event": "bye"})


if __name__ == "__main__":
    main()
