"""The receiving side of the push-path benchmark, in its own process (a decoder's KV memory).

Started by scripts.bench.push_path; not meant to be run by hand. Argument: JSON
{"bytes": N}. Allocates N bytes, touches every page (a real KV cache is resident),
registers them with its own Mooncake engine on 127.0.0.1 over TCP, prints
{"session", "base"} and then answers JSON commands on stdin:
  {"cmd": "crc", "spans": [[offset, length], ...]}  -> {"crc": [...]}  (zlib.crc32 per span)
  {"cmd": "zero"}                                  -> {"ok": true}
  {"cmd": "quit"}
"""

from __future__ import annotations

import json
import sys
import zlib

import numpy as np


def say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    from mooncake.engine import TransferEngine

    buf = np.empty(int(cfg["bytes"]), dtype=np.uint8)
    buf.fill(0)
    base = int(buf.ctypes.data)
    eng = TransferEngine()
    code = eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if code != 0:
        say({"error": f"initialize -> {code}"})
        return
    code = eng.batch_register_memory([base], [buf.nbytes])
    if code != 0:
        say({"error": f"register -> {code}"})
        return
    say({"session": f"127.0.0.1:{eng.get_rpc_port()}", "base": base})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "crc":
            say({"crc": [zlib.crc32(buf[o : o + n]) for o, n in cmd["spans"]]})
        elif cmd["cmd"] == "zero":
            buf.fill(0)
            say({"ok": True})
        elif cmd["cmd"] == "quit":
            break
    eng.batch_unregister_memory([base])
    say({"event": "bye"})


if __name__ == "__main__":
    main()
