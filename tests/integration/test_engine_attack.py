"""The Mooncake engine's ports as an attacker sees them, and the firewall recipe that closes them.

The engine has no authentication: whoever reaches its handshake port and TCP data port
can read and overwrite every registered buffer. This engine version also cannot bind
those ports to one address (both listen on all interfaces whatever host it is given), so
the protection is the network: only the peer instances' KV addresses may reach them.
These tests show the attack for real (an attacker with its own TransferEngine reading and
overwriting a victim's buffer through an address the victim was never given), then show
the nftables recipe (scripts/netns.py ``kv_only``) stopping it from the front network while
the trusted peer on the KV network still writes. Every address is loopback or inside
namespaces the test creates.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from connector.transport import MooncakeTransport, TransferError
from scripts import netns
from tests.integration.engine_peer import raw

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SIZE = 4096
SECRET = 0xAB  # the victim's "KV cache": SIZE bytes of 0xAB
MC_MIN, MC_MAX = 15100, 15131


class Engine:
    """tests/integration/engine_peer.py in a child process (optionally inside a namespace)."""

    def __init__(
        self, host: str, fill: int | None, wrap: list[str] | None = None, env: dict | None = None
    ) -> None:
        argv = [sys.executable, "-m", "tests.integration.engine_peer"]
        argv.append(json.dumps({"host": host, "size": SIZE, "fill": fill}))
        self.proc = subprocess.Popen(
            [*(wrap or []), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            text=True,
            env={**os.environ, "MC_LOG_LEVEL": "ERROR", **(env or {})},
        )
        ready = self._read(60)
        assert ready.get("code") == 0, ready
        self.info = self.call(cmd="info")

    @property
    def addr(self) -> int:
        return int(self.info["addr"])

    @property
    def data_port(self) -> int:
        """The TCP data port (the listener that is not the handshake port)."""
        ports = {x["port"] for x in self.info["listeners"]} - {self.info["rpc_port"]}
        assert len(ports) == 1, self.info
        return ports.pop()

    def session_via(self, host: str) -> str:
        """This engine's session as someone who reaches it at ``host`` would write it."""
        return f"{host}:{self.info['rpc_port']}"

    def _read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, "engine process did not answer"
        line = self.proc.stdout.readline()
        assert line, f"engine process exited with {self.proc.poll()}"
        return json.loads(line)

    def call(self, timeout: float = 120, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def memory(self) -> bytes:
        return bytes.fromhex(self.call(cmd="dump")["data"])

    def read(self, session: str, addr: int, size: int = 16) -> dict:
        return self.call(cmd="read", session=session, addr=addr, size=size)

    def write(self, session: str, addr: int, data: bytes) -> dict:
        return self.call(cmd="write", session=session, addr=addr, data=data.hex())

    def raw(self, host: str, port: int, addr: int, size: int = 0, data: bytes = b"") -> dict:
        """A plain-socket read or write from this engine's process (its namespace)."""
        return self.call(cmd="raw", host=host, port=port, addr=addr, size=size, data=data.hex())

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # in case a test left it stopped
            try:
                self.call(timeout=20, cmd="quit")
                self.proc.wait(10)
            except (AssertionError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    started: list[Engine] = []
    yield started
    for e in reversed(started):
        e.close()


def start(engines: list[Engine], *args, **kwargs) -> Engine:
    e = Engine(*args, **kwargs)
    engines.append(e)
    return e


# --- loopback: the engine itself offers no boundary ----------------------------------------


def test_engine_listens_on_every_interface_whatever_host_it_is_given(engines):
    """Pins the engine behaviour the firewall advice rests on; if a later engine binds to
    the host it is given, this fails, and the lab can rely on the bind instead."""
    victim = start(engines, "127.0.0.1", SECRET)
    listeners = victim.info["listeners"]
    assert len(listeners) == 2, listeners  # handshake (RPC) port and TCP data port
    assert {x["port"] for x in listeners} >= {victim.info["rpc_port"]}
    assert all(x["host"] in ("0.0.0.0", "::") for x in listeners), listeners


def test_an_engine_peer_reads_and_overwrites_through_an_address_the_victim_was_not_given(
    engines,
):
    """The finding, reproduced: victim initialised on 127.0.0.1, attacker on 127.0.0.2
    dials the victim as 127.0.0.2:port; no secret, no check: it reads the KV bytes and
    overwrites them."""
    victim = start(engines, "127.0.0.1", SECRET)
    attacker = start(engines, "127.0.0.2", None)
    session = victim.session_via("127.0.0.2")
    got = attacker.read(session, victim.addr, 16)
    assert got["code"] == 0 and bytes.fromhex(got["data"]) == bytes([SECRET]) * 16
    assert attacker.write(session, victim.addr, b"\xee" * 16)["code"] == 0
    assert victim.memory()[:17] == b"\xee" * 16 + bytes([SECRET])


def test_a_plain_socket_reads_and_writes_the_data_port_with_no_handshake(engines):
    """Not even an engine is needed: the data port takes a 24-byte header naming any
    address inside a registered buffer (addresses outside are refused)."""
    victim = start(engines, "127.0.0.1", SECRET)
    got = raw("127.0.0.2", victim.data_port, victim.addr, size=16)
    assert got["ok"] and bytes.fromhex(got["data"]) == bytes([SECRET]) * 16
    assert raw("127.0.0.2", victim.data_port, victim.addr + 8, data=b"\xee" * 8)["ok"]
    assert victim.memory()[:17] == bytes([SECRET]) * 8 + b"\xee" * 8 + bytes([SECRET])
    outside = raw("127.0.0.2", victim.data_port, 4096, size=16)
    assert not outside["ok"]


def test_transport_warns_with_the_ports_and_sets_the_transfer_timeout_only_for_the_engine(
    caplog, monkeypatch
):
    monkeypatch.delenv("MC_TRANSFER_TIMEOUT", raising=False)
    caplog.set_level(logging.INFO, logger="vllm.pd_connector")
    t = MooncakeTransport("127.0.0.1", "tcp", transfer_timeout_s=3)
    try:
        assert t.transfer_timeout_s == 5  # the engine's minimum
        assert "MC_TRANSFER_TIMEOUT" not in os.environ  # not leaked to other engines
        assert len(t.listeners) == 2 and all(s.wildcard for s in t.listeners)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        for s in t.listeners:
            assert f"{s.port} on {s.host}" in warnings[0]
        assert "MC_TRANSFER_TIMEOUT=5 (set)" in caplog.text
    finally:
        t.close()


def test_operator_transfer_timeout_wins(caplog, monkeypatch):
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "7")
    caplog.set_level(logging.INFO, logger="vllm.pd_connector")
    t = MooncakeTransport("127.0.0.1", "tcp", transfer_timeout_s=20)
    try:
        assert t.transfer_timeout_s == 7
        assert os.environ["MC_TRANSFER_TIMEOUT"] == "7"
        assert "MC_TRANSFER_TIMEOUT=7 (operator's)" in caplog.text
    finally:
        t.close()


def test_push_to_a_frozen_peer_fails_after_the_transfer_timeout(engines, monkeypatch):
    """A decoder that stops answering (SIGSTOP) holds a push for MC_TRANSFER_TIMEOUT, not
    the engine's default 30 s, once the connection exists (a first handshake to a frozen
    peer is not bounded by it)."""
    monkeypatch.delenv("MC_TRANSFER_TIMEOUT", raising=False)
    peer = start(engines, "127.0.0.1", 0)
    t = MooncakeTransport("127.0.0.1", "tcp", transfer_timeout_s=5)
    import ctypes

    src = ctypes.create_string_buffer(b"\x5a" * 64)
    t.register([(ctypes.addressof(src), 64)])
    session = peer.info["session"]
    try:
        t.write(session, [ctypes.addressof(src)], [peer.addr], [64])  # connects
        os.kill(peer.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            t.write(session, [ctypes.addressof(src)], [peer.addr], [64])
        blocked = time.monotonic() - t0
        os.kill(peer.proc.pid, signal.SIGCONT)
        assert 4.5 < blocked < 8, blocked
        t.write(session, [ctypes.addressof(src)], [peer.addr], [64])  # the path recovers
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
        t.close()
    del src


# --- the firewall recipe, in namespaces ---------------------------------------------------


@pytest.fixture
def lab() -> Iterator[netns.TwoHostNet]:
    why = netns.available()
    if why:
        pytest.skip(f"namespace lab unavailable: {why}")
    if subprocess.run(["which", "nft"], capture_output=True).returncode != 0:
        pytest.skip("nftables ('nft') is not installed")
    with netns.TwoHostNet() as net:
        yield net


def start_in(engines: list[Engine], net: netns.TwoHostNet, ns: str, host: str, fill) -> Engine:
    env = {"MC_MIN_RPC_PORT": str(MC_MIN), "MC_MAX_RPC_PORT": str(MC_MAX)}
    return start(engines, host, fill, wrap=net.wrap(ns, []), env=env)


def test_firewall_recipe_stops_the_front_network_and_keeps_the_kv_peer(engines, lab):
    """Victim = decode host B, advertising its KV address; attacker = front host X, which
    shares only the front network with B; trusted peer = prefill host A on the KV network.
    Without the recipe X reads B's KV bytes both ways: a plain socket to B's front address
    (the data port listens there too) and its own engine once it routes the KV subnet via
    B's front address (Linux accepts packets for any local address on any interface, so
    binding alone would not stop a neighbour on the front network). With the recipe (B's
    Mooncake ports only from A's KV address arriving on the KV interface) both are refused
    at once and the buffer is untouched, while A still writes: the trust boundary is who
    can reach the KV interface."""
    victim = start_in(engines, lab, lab.b, netns.KV_B, SECRET)
    attacker = start_in(engines, lab, lab.x, netns.FRONT_B_X, None)
    trusted = start_in(engines, lab, lab.a, netns.KV_A, 0x11)
    lab.route(lab.x, netns.KV_NET, netns.FRONT_B)
    session = victim.session_via(netns.KV_B)

    # No firewall: the front host gets in.
    sock = attacker.raw(netns.FRONT_B, victim.data_port, victim.addr, size=16)
    assert sock["ok"] and bytes.fromhex(sock["data"]) == bytes([SECRET]) * 16, sock
    engine = attacker.read(session, victim.addr, 16)
    assert engine["code"] == 0 and bytes.fromhex(engine["data"]) == bytes([SECRET]) * 16

    lab.kv_only(lab.b, MC_MIN, MC_MAX, peers=[netns.KV_A])
    t0 = time.monotonic()
    for port in (victim.data_port, int(victim.info["rpc_port"])):
        for host in (netns.FRONT_B, netns.KV_B):
            assert not attacker.raw(host, port, victim.addr, size=16)["ok"], (host, port)
            assert not attacker.raw(host, port, victim.addr, data=b"\xee" * 16)["ok"]
    assert attacker.read(session, victim.addr, 16)["code"] != 0
    assert attacker.write(session, victim.addr, b"\xee" * SIZE)["code"] != 0
    assert time.monotonic() - t0 < 15  # refused with a reset, not hanging
    assert victim.memory() == bytes([SECRET]) * SIZE

    # The trusted peer on the KV network writes through the same firewall.
    ok = trusted.write(session, victim.addr, b"\x11" * 32)
    assert ok["code"] == 0, ok
    assert victim.memory()[:33] == b"\x11" * 32 + bytes([SECRET])


def test_pushing_peer_needs_no_inbound_mooncake_port(engines, lab):
    """Over TCP only the receiving (decode) side's ports must be reachable: the pushing
    (prefill) side's engine ports can be closed to everyone."""
    victim = start_in(engines, lab, lab.b, netns.KV_B, 0)
    pusher = start_in(engines, lab, lab.a, netns.KV_A, 0x22)
    lab.kv_only(lab.a, MC_MIN, MC_MAX, peers=[])
    lab.kv_only(lab.b, MC_MIN, MC_MAX, peers=[netns.KV_A])
    for _ in range(2):
        ok = pusher.write(victim.session_via(netns.KV_B), victim.addr, b"\x22" * 64)
        assert ok["code"] == 0, ok
    assert victim.memory()[:64] == b"\x22" * 64
