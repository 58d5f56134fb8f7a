"""What the Mooncake engine exposes on the network, and the environment we give it.

The engine (0.3.13) has no authentication: whoever reaches its handshake port and its TCP
data port can read and overwrite every registered buffer (the KV cache). It also has no
setting that binds those two listeners to one address: in P2P-handshake mode both listen
on all interfaces whatever host it is given (``MC_TCP_BIND_ADDRESS`` only picks the
address it advertises outside P2P mode). So the connector cannot close them itself; it can
bound how long a push to a frozen peer blocks, check from /proc which addresses the
engine's sockets really listen on, and say loudly when they must be firewalled. The logic
lives here, free of the engine, so it can be unit-tested.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

# TransferEnginePy's constructor reads it: seconds, integer, at least 5, default 30.
TRANSFER_TIMEOUT_ENV = "MC_TRANSFER_TIMEOUT"
ENGINE_MIN_TRANSFER_TIMEOUT_S = 5
ENGINE_DEFAULT_TRANSFER_TIMEOUT_S = 30
# The engine picks both listening ports in this range (defaults 15000..17000).
PORT_RANGE_ENV = ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT")
DEFAULT_PORT_RANGE = (15000, 17000)

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column
_SOCKET_LINK = re.compile(r"^socket:\[(\d+)\]$")


@dataclass(frozen=True, order=True)
class Listener:
    """One listening TCP socket: its local address and port."""

    host: str
    port: int
    inode: int = 0

    @property
    def wildcard(self) -> bool:
        """Listening on every interface (0.0.0.0 or ::), so every network reaches it."""
        return is_wildcard(self.host)


def is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _decode_addr(hexaddr: str) -> str:
    """/proc/net/tcp{,6} print addresses as the kernel's 32-bit words in host byte order."""
    raw = bytes.fromhex(hexaddr)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(raw)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)  # a v6 socket bound to ::ffff:a.b.c.d serves only that
    return str(addr)


def parse_proc_net_tcp(text: str) -> list[Listener]:
    """The LISTEN sockets of one /proc/net/tcp or /proc/net/tcp6 table."""
    out: list[Listener] = []
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10 or cols[3] != _LISTEN:
            continue
        hexaddr, _, hexport = cols[1].partition(":")
        out.append(Listener(_decode_addr(hexaddr), int(hexport, 16), int(cols[9])))
    return out


def socket_inodes(pid: int, proc: Path = Path("/proc")) -> set[int]:
    """Inodes of the sockets process ``pid`` holds open (unreadable fds are skipped)."""
    inodes: set[int] = set()
    fd_dir = proc / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return inodes
    for name in names:
        try:
            m = _SOCKET_LINK.match(os.readlink(fd_dir / name))
        except OSError:
            continue
        if m:
            inodes.add(int(m.group(1)))
    return inodes


def listening_sockets_of(pid: int, proc: Path = Path("/proc")) -> list[Listener]:
    """The TCP sockets ``pid`` listens on, as its own network namespace sees them."""
    tables = []
    for name in ("tcp", "tcp6"):
        try:
            tables.append((proc / str(pid) / "net" / name).read_text())
        except OSError:
            continue
    mine = socket_inodes(pid, proc)
    found = {s for text in tables for s in parse_proc_net_tcp(text) if s.inode in mine}
    return sorted(found)


def new_listeners(before: Iterable[Listener], after: Iterable[Listener]) -> list[Listener]:
    """Sockets that appeared between two snapshots: what the engine's start-up opened."""
    old = {s.inode for s in before}
    return sorted(s for s in after if s.inode not in old)


def exposure_warning(
    listeners: Iterable[Listener], kv_host: str, ports_from: tuple[int, int] | None = None
) -> str | None:
    """A warning naming each engine port that listens beyond ``kv_host``, or None."""
    wide = sorted({(s.port, s.host) for s in listeners if s.host != kv_host})
    if not wide:
        return None
    where = ", ".join(f"{port} on {host}" for port, host in wide)
    ports = ",".join(str(p) for p in sorted({p for p, _ in wide}))
    drawn = f" (drawn from {ports_from[0]}-{ports_from[1]})" if ports_from else ""
    return (
        f"mooncake engine listens on more than the KV address {kv_host}: {where}. "
        "Anyone who can connect to these ports can read and overwrite the registered KV "
        f"cache (the engine has no authentication): allow TCP ports {ports}{drawn} only "
        "from the peer instances' KV addresses (host firewall / security group)"
    )


@dataclass
class EnvPlan:
    """Environment values to set before the engine is created, and why."""

    apply: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)  # the operator's own, left alone

    def describe(self) -> str:
        parts = [f"{k}={v} (set)" for k, v in sorted(self.apply.items())]
        parts += [f"{k}={v} (operator's)" for k, v in sorted(self.kept.items())]
        return ", ".join(parts) or "engine defaults"


def transfer_timeout_value(seconds: float) -> str:
    """MC_TRANSFER_TIMEOUT for ``seconds``: whole seconds, rounded up, engine minimum 5."""
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"transfer timeout must be a positive number of seconds: {seconds}")
    return str(max(ENGINE_MIN_TRANSFER_TIMEOUT_S, math.ceil(seconds)))


def plan_env(environ: Mapping[str, str], transfer_timeout_s: float | None) -> EnvPlan:
    """What to set for the engine; a value the operator exported always wins."""
    plan = EnvPlan()
    if TRANSFER_TIMEOUT_ENV in environ:
        plan.kept[TRANSFER_TIMEOUT_ENV] = environ[TRANSFER_TIMEOUT_ENV]
    elif transfer_timeout_s is not None:
        plan.apply[TRANSFER_TIMEOUT_ENV] = transfer_timeout_value(transfer_timeout_s)
    for name in PORT_RANGE_ENV:
        if name in environ:
            plan.kept[name] = environ[name]
    return plan


def effective_transfer_timeout_s(environ: Mapping[str, str]) -> int:
    """The bound the engine will apply to one synchronous transfer, as it parses it."""
    raw = environ.get(TRANSFER_TIMEOUT_ENV)
    if raw is None:
        return ENGINE_DEFAULT_TRANSFER_TIMEOUT_S
    m = re.match(r"\s*[+-]?\d+", raw)  # atoi: leading integer, 0 when there is none
    return max(ENGINE_MIN_TRANSFER_TIMEOUT_S, int(m.group(0)) if m else 0)


def port_range(environ: Mapping[str, str]) -> tuple[int, int]:
    """The range the engine draws its two ports from (for the firewall advice)."""
    lo, hi = DEFAULT_PORT_RANGE
    try:
        lo = int(environ.get(PORT_RANGE_ENV[0], lo))
        hi = int(environ.get(PORT_RANGE_ENV[1], hi))
    except ValueError:
        pass
    return lo, hi
