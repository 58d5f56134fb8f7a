"""Where the engine listens (/proc parsing) and the environment we give it, without the engine."""

from __future__ import annotations

import os
import socket

import pytest

from connector.engine_exposure import (
    EnvPlan,
    Listener,
    effective_transfer_timeout_s,
    exposure_warning,
    is_wildcard,
    listening_sockets_of,
    new_listeners,
    parse_proc_net_tcp,
    plan_env,
    port_range,
    socket_inodes,
    transfer_timeout_value,
)

HEAD4 = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid ...\n"
HEAD6 = "  sl  local_address                         remote_address                        st ...\n"


def row(local: str, state: str, inode: int, remote: str = "00000000:0000") -> str:
    return (
        f"   0: {local} {remote} {state} 00000000:00000000 00:00000000 00000000     0        0 "
        f"{inode} 1 0000000000000000 100 0 0 10 0\n"
    )


def test_parses_ipv4_listeners_and_skips_other_states():
    text = HEAD4 + row("00000000:3B71", "0A", 11)  # 0.0.0.0:15217
    text += row("0100007F:3CC2", "0A", 12)  # 127.0.0.1:15554
    text += row("0201A8C0:1F90", "0A", 13)  # 192.168.1.2:8080
    text += row("0100007F:3CC3", "01", 14, "0100007F:9C40")  # established: not a listener
    assert parse_proc_net_tcp(text) == [
        Listener("0.0.0.0", 15217, 11),
        Listener("127.0.0.1", 15554, 12),
        Listener("192.168.1.2", 8080, 13),
    ]


def test_parses_ipv6_listeners_and_v4_mapped_addresses():
    any6 = "0" * 32
    lo6 = "00000000000000000000000001000000"  # ::1
    mapped = "0000000000000000FFFF00000100007F"  # ::ffff:127.0.0.1
    text = HEAD6 + row(f"{any6}:3DA4", "0A", 21, "0" * 32 + ":0000")
    text += row(f"{lo6}:3D65", "0A", 22, "0" * 32 + ":0000")
    text += row(f"{mapped}:3D66", "0A", 23, "0" * 32 + ":0000")
    got = parse_proc_net_tcp(text)
    assert got == [
        Listener("::", 0x3DA4, 21),
        Listener("::1", 0x3D65, 22),
        Listener("127.0.0.1", 0x3D66, 23),
    ]
    assert [s.wildcard for s in got] == [True, False, False]


def test_garbage_lines_are_ignored():
    assert parse_proc_net_tcp("") == []
    assert parse_proc_net_tcp(HEAD4 + "nonsense\n   1: short\n") == []


@pytest.mark.parametrize(
    ("host", "wild"),
    [("0.0.0.0", True), ("::", True), ("127.0.0.1", False), ("10.0.0.1", False), ("h", False)],
)
def test_wildcard(host, wild):
    assert is_wildcard(host) is wild


def test_socket_inodes_reads_fd_links(tmp_path):
    fd = tmp_path / "42" / "fd"
    fd.mkdir(parents=True)
    os.symlink("socket:[777]", fd / "3")
    os.symlink("pipe:[5]", fd / "4")
    os.symlink("/dev/null", fd / "5")
    assert socket_inodes(42, tmp_path) == {777}
    assert socket_inodes(43, tmp_path) == set()  # no such process: nothing, no error


def test_listening_sockets_of_a_fake_process(tmp_path):
    (tmp_path / "7" / "fd").mkdir(parents=True)
    (tmp_path / "7" / "net").mkdir()
    os.symlink("socket:[11]", tmp_path / "7" / "fd" / "3")
    (tmp_path / "7" / "net" / "tcp").write_text(
        HEAD4 + row("00000000:3B71", "0A", 11) + row("0100007F:3CC2", "0A", 99)
    )
    # No tcp6 table (IPv6 disabled): still fine. Inode 99 belongs to someone else.
    assert listening_sockets_of(7, tmp_path) == [Listener("0.0.0.0", 15217, 11)]


def test_finds_this_process_listeners_in_real_proc():
    """The real /proc: a socket we bind to loopback shows up with its address."""
    before = listening_sockets_of(os.getpid())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        opened = new_listeners(before, listening_sockets_of(os.getpid()))
    assert [(x.host, x.port) for x in opened] == [("127.0.0.1", port)]
    assert not opened[0].wildcard


def test_warning_names_ports_beyond_the_kv_host():
    engine = [Listener("0.0.0.0", 15100, 1), Listener("::", 15101, 2)]
    msg = exposure_warning(engine, "10.0.0.5", (15100, 15131))
    assert msg is not None
    assert "15100 on 0.0.0.0" in msg and "15101 on ::" in msg
    assert "TCP ports 15100,15101 (drawn from 15100-15131)" in msg
    assert "10.0.0.5" in msg


def test_no_warning_when_bound_to_the_kv_host_only():
    assert exposure_warning([Listener("10.0.0.5", 15100, 1)], "10.0.0.5") is None
    assert exposure_warning([], "10.0.0.5") is None
    # Bound to one address, but not the advertised one: still worth a warning.
    assert exposure_warning([Listener("10.0.0.6", 15100, 1)], "10.0.0.5") is not None


@pytest.mark.parametrize(
    ("seconds", "want"), [(0.5, "5"), (5, "5"), (5.01, "6"), (12, "12"), (29.2, "30")]
)
def test_transfer_timeout_is_whole_seconds_at_least_the_engine_minimum(seconds, want):
    assert transfer_timeout_value(seconds) == want


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_transfer_timeout_rejects_nonsense(bad):
    with pytest.raises(ValueError):
        transfer_timeout_value(bad)


def test_plan_sets_the_timeout_only_when_asked_and_not_set_by_the_operator():
    assert plan_env({}, None) == EnvPlan()
    assert plan_env({}, 8).apply == {"MC_TRANSFER_TIMEOUT": "8"}
    operator = plan_env({"MC_TRANSFER_TIMEOUT": "60", "MC_MIN_RPC_PORT": "15100"}, 8)
    assert operator.apply == {}
    assert operator.kept == {"MC_TRANSFER_TIMEOUT": "60", "MC_MIN_RPC_PORT": "15100"}
    assert "MC_TRANSFER_TIMEOUT=60 (operator's)" in operator.describe()
    assert plan_env({}, 3).describe() == "MC_TRANSFER_TIMEOUT=5 (set)"
    assert plan_env({}, None).describe() == "engine defaults"


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, 30),
        ({"MC_TRANSFER_TIMEOUT": "12"}, 12),
        ({"MC_TRANSFER_TIMEOUT": "2"}, 5),
        ({"MC_TRANSFER_TIMEOUT": "7.9"}, 7),
        ({"MC_TRANSFER_TIMEOUT": "soon"}, 5),
    ],
)
def test_effective_timeout_parses_like_the_engine(env, want):
    assert effective_transfer_timeout_s(env) == want


def test_port_range():
    assert port_range({}) == (15000, 17000)
    assert port_range({"MC_MIN_RPC_PORT": "15100", "MC_MAX_RPC_PORT": "15131"}) == (15100, 15131)
    assert port_range({"MC_MIN_RPC_PORT": "x"}) == (15000, 17000)
