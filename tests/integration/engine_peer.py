"""A bare Mooncake engine with one registered buffer, in its own process, driven over stdin.

The attack tests need several independent engines (victim, attacker, trusted peer), each
with its own sockets and memory, and some of them inside a network namespace
(``ip netns exec`` runs this module there); a frozen-peer measurement needs a process it
can SIGSTOP. argv[1]: JSON ``{"host", "size", "fill"}`` (fill: a byte value, or null for
zeros). JSON commands on stdin, one JSON answer line each on stdout:
  {"cmd": "info"}                                   session, rpc_port, addr, size, listeners
  {"cmd": "dump"}                                   the buffer's bytes, hex
  {"cmd": "read", "session", "addr", "size"}        pull a peer's bytes into our buffer
  {"cmd": "write", "session", "addr", "data"}       push hex bytes into a peer's buffer
  {"cmd": "raw", "host", "port", "addr", "size" | "data"}
        no engine at all: the TCP data port's own framing, read (size) or write (data)
  {"cmd": "quit"}
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import struct
import sys
import time

from connector.engine_exposure import listening_sockets_of


def say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def raw(host: str, port: int, addr: int, size: int = 0, data: bytes = b"") -> dict:
    """Speak the data port's framing (a 24-byte header: size, address, opcode 0 read /
    1 write) from a plain socket: no handshake, no engine, no secret."""
    payload = data
    try:
        with socket.create_connection((host, port), timeout=3) as s:
            if payload:
                s.sendall(struct.pack("<QQB7x", len(payload), addr, 1) + payload)
                time.sleep(0.3)  # v1 framing has no acknowledgement
                return {"ok": True, "data": ""}
            s.sendall(struct.pack("<QQB7x", size, addr, 0))
            got = b""
            while len(got) < size:
                chunk = s.recv(size - len(got))
                if not chunk:
                    break
                got += chunk
            return {"ok": len(got) == size, "data": got.hex()}
    except OSError as exc:
        return {"ok": False, "error": repr(exc)}


def main() -> None:
    from mooncake.engine import TransferEngine

    cfg = json.loads(sys.argv[1])
    size = int(cfg["size"])
    fill = cfg["fill"]
    buf = ctypes.create_string_buffer(bytes([fill]) * size if fill is not None else size)
    addr = ctypes.addressof(buf)
    engine = TransferEngine()
    code = engine.initialize(cfg["host"], "P2PHANDSHAKE", "tcp", "")
    if code == 0:
        code = engine.register_memory(addr, size)
    rpc_port = int(engine.get_rpc_port()) if code == 0 else 0
    say({"event": "ready", "code": code, "rpc_port": rpc_port})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["cmd"]
        if op == "info":
            listeners = [
                {"host": s.host, "port": s.port} for s in listening_sockets_of(os.getpid())
            ]
            say(
                {
                    "session": f"{cfg['host']}:{rpc_port}",
                    "rpc_port": rpc_port,
                    "addr": addr,
                    "size": size,
                    "listeners": listeners,
                }
            )
        elif op == "dump":
            say({"data": ctypes.string_at(addr, size).hex()})
        elif op == "read":
            t0 = time.monotonic()
            code = engine.transfer_sync_read(cmd["session"], addr, cmd["addr"], cmd["size"])
            data = ctypes.string_at(addr, cmd["size"]).hex() if code == 0 else ""
            say({"code": code, "data": data, "elapsed": time.monotonic() - t0})
        elif op == "write":
            payload = bytes.fromhex(cmd["data"])
            ctypes.memmove(addr, payload, len(payload))
            t0 = time.monotonic()
            code = engine.batch_transfer_sync_write(
                cmd["session"], [addr], [cmd["addr"]], [len(payload)]
            )
            say({"code": code, "elapsed": time.monotonic() - t0})
        elif op == "raw":
            data = bytes.fromhex(cmd.get("data", ""))
            say(raw(cmd["host"], cmd["port"], cmd["addr"], cmd.get("size", 0), data))
        elif op == "quit":
            break
    say({"event": "bye"})
    # The engine may still touch the buffer after a failed transfer: keep it alive to the end.
    del engine
    del buf


if __name__ == "__main__":
    main()
