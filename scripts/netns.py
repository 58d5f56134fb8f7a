"""A two-host lab on one machine: network namespaces joined by veth pairs.

    prefill host (ns A) ── kv network 10.77.1.0/24 ── decode host (ns B)
          │ 10.77.2.0/24                                  │ 10.77.3.0/24
          └────────────── front host (ns X: proxy, client) ┘

The KV network carries only the side channel and the transfer engine's traffic; the
front networks carry HTTP. A connector that advertised the wrong address (loopback, or a
front address) cannot reach its peer here, which is what this lab is for. Every address
lives inside namespaces this lab creates, and :meth:`TwoHostNet.close` deletes them
(their veth links go with them) on every exit path. Needs root and iproute2.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

KV_NET = "10.77.1.0/24"
KV_A, KV_B = "10.77.1.1", "10.77.1.2"
FRONT_A_X, FRONT_A = "10.77.2.1", "10.77.2.2"
FRONT_B_X, FRONT_B = "10.77.3.1", "10.77.3.2"


def available() -> str | None:
    """None if this lab can run here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed: run scripts/setup.sh"
    probe = f"pdprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {r.stderr.strip()}")


@dataclass
class TwoHostNet:
    prefix: str = field(default_factory=lambda: f"pd{os.getpid()}")
    created: list[str] = field(default_factory=list)

    @property
    def a(self) -> str:
        return f"{self.prefix}A"

    @property
    def b(self) -> str:
        return f"{self.prefix}B"

    @property
    def x(self) -> str:
        return f"{self.prefix}X"

    @staticmethod
    def reap_stale() -> list[str]:
        """Delete this lab's namespaces left by a run that was killed (its PID is gone)."""
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        reaped = []
        for name in re.findall(r"^(pd(\d+)[ABX])\b", out, re.M):
            ns, pid = name[0], int(name[1])
            if not os.path.exists(f"/proc/{pid}"):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
                reaped.append(ns)
        return reaped

    def open(self) -> TwoHostNet:
        self.reap_stale()
        try:
            for ns in (self.a, self.b, self.x):
                _ip("netns", "add", ns)
                self.created.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            self._link(self.a, "kv", KV_A, self.b, "kv", KV_B)
            self._link(self.x, "fa", FRONT_A_X, self.a, "front", FRONT_A)
            self._link(self.x, "fb", FRONT_B_X, self.b, "front", FRONT_B)
        except BaseException:
            self.close()
            raise
        return self

    def _link(self, ns1: str, if1: str, addr1: str, ns2: str, if2: str, addr2: str) -> None:
        _ip("link", "add", if1, "netns", ns1, "type", "veth", "peer", "name", if2, "netns", ns2)
        for ns, ifname, addr in ((ns1, if1, addr1), (ns2, if2, addr2)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")

    def route(self, ns: str, dest: str, via: str) -> None:
        """Add a route in ``ns`` (e.g. an attacker pointing the KV subnet at a front address)."""
        _ip("-n", ns, "route", "add", dest, "via", via)

    def unroute(self, ns: str, dest: str) -> None:
        _ip("-n", ns, "route", "del", dest)

    def listening_ports(self, ns: str, first: int, last: int) -> list[int]:
        """TCP ports first..last that something listens on inside ``ns`` (via ss)."""
        r = subprocess.run(self.wrap(ns, ["ss", "-ltnH"]), capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"ss in {ns} failed: {r.stderr.strip()}")
        ports = {int(line.split()[3].rpartition(":")[2]) for line in r.stdout.splitlines()}
        return sorted(p for p in ports if first <= p <= last)

    def close(self) -> None:
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created.clear()

    def __enter__(self) -> TwoHostNet:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def wrap(ns: str, argv: Sequence[str]) -> list[str]:
        """argv run inside namespace ``ns`` (``ip netns exec`` execs it: same PID)."""
        return ["ip", "netns", "exec", ns, *argv]

    def nft(self, ns: str, *rules: str) -> None:
        """Load nftables commands into ``ns`` (its own ruleset; the host's is untouched)."""
        r = subprocess.run(
            self.wrap(ns, ["nft", "-f", "-"]),
            input="\n".join(rules) + "\n",
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise RuntimeError(f"nft in {ns} failed: {r.stderr.strip()}")

    def block_tcp_ports(self, ns: str, first: int, last: int) -> None:
        """Refuse inbound TCP to ports first..last in ``ns`` with a reset (a closed port)."""
        self.nft(
            ns,
            "add table inet pdblock",
            "add chain inet pdblock input { type filter hook input priority 0; policy accept; }",
            f"add rule inet pdblock input tcp dport {first}-{last} reject with tcp reset",
        )

    def unblock(self, ns: str) -> None:
        self.nft(ns, "delete table inet pdblock")

    def kv_only(
        self, ns: str, first: int, last: int, peers: Sequence[str], iface: str = "kv"
    ) -> None:
        """The firewall recipe for the Mooncake engine's ports in ``ns``.

        The engine listens on every interface and has no authentication, so TCP to ports
        first..last is accepted only from the peers' KV addresses arriving on the KV
        interface, and reset otherwise: from the front network, over IPv6 (the data port
        is dual-stack), from local processes. An empty ``peers`` closes the ports to all.
        Its own table, so :meth:`block_tcp_ports` / :meth:`unblock` leave it alone.
        """
        rules = [
            "add table inet pdkv",
            "add chain inet pdkv input { type filter hook input priority -10; policy accept; }",
        ]
        if peers:
            rules.append(
                f'add rule inet pdkv input iifname "{iface}" ip saddr {{ {", ".join(peers)} }} '
                f"tcp dport {first}-{last} accept"
            )
        rules.append(f"add rule inet pdkv input tcp dport {first}-{last} reject with tcp reset")
        self.nft(ns, *rules)

    def kv_open(self, ns: str) -> None:
        """Remove :meth:`kv_only`'s table (to show what it was protecting)."""
        self.nft(ns, "delete table inet pdkv")
