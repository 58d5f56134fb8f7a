"""1P1D across two 'hosts' (network namespaces), proxy on a third; then blocked ports.

The prefiller and decoder advertise their KV-network addresses; HTTP uses separate front
networks. Token-exact equivalence across them proves the advertised-host and port logic
for real. Then a firewall rule inside a namespace blocks a port the transfer needs, and
the failure must be reported quickly and clearly, the request still answered (the decoder
recomputes: kv_load_failure_policy=recompute) and no KV block left held on either side.

The Mooncake engine has no authentication and listens on every interface, so the lab runs
with the firewall recipe an operator needs (scripts/netns.py ``kv_only``): the decoder's
engine ports take TCP only from the prefiller's KV address on the KV interface, the
prefiller's from no one. A test checks that the front host cannot reach either while P/D
works over the KV network.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from scripts import netns
from scripts.pdlab import ROOT, Child, kv_config, prompt_tokens_by_source, vllm_child
from tests.e2e.cases import MODEL_DIR, completion_cases, prompt_len, reference

pytestmark = pytest.mark.e2e

BLOCK = 32
P_PORT, D_PORT, X_PORT, SIDE = 8100, 8200, 8000, 17100
MC_MIN, MC_MAX = 15100, 15131
PULL_TIMEOUT_S, EXPIRY_S = 5, 8
# A failed push's blocks stay held this long (the engine may deliver the write later).
HOLD_S = 4


@dataclass
class Lab:
    net: netns.TwoHostNet
    prefill: Child
    decode: Child
    proxy: Child
    ref: dict[str, list[int]]
    log_dir: Path

    def client(self, cmd: dict, timeout: float = 300) -> dict:
        """Run tests/e2e/netns_client.py inside the front namespace."""
        argv = self.net.wrap(self.net.x, [sys.executable, "-m", "tests.e2e.netns_client"])
        r = subprocess.run(
            argv, input=json.dumps(cmd), capture_output=True, text=True, cwd=ROOT, timeout=timeout
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout)

    def complete(self, names: list[str], stream: bool = False) -> dict:
        cases = completion_cases(BLOCK)
        reqs = [
            {
                "name": n,
                "path": "/v1/completions",
                "body": {"model": "tiny-llama", **cases[n], "stream": stream},
            }
            for n in names
        ]
        base = f"http://{netns.FRONT_A_X}:{X_PORT}"
        return self.client({"cmd": "run", "base": base, "requests": reqs})

    def metrics(self, host: str, port: int) -> str:
        url = f"http://{host}:{port}/metrics"
        return self.client({"cmd": "get", "urls": [url]})[url]

    def sources(self) -> dict[str, float]:
        return prompt_tokens_by_source(self.metrics(netns.FRONT_B, D_PORT))


def kv_usage(text: str) -> float:
    m = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([\d.e+-]+)$", text, re.M)
    assert m, "no kv_cache_usage_perc"
    return float(m.group(1))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    why = netns.available()
    if why:
        pytest.skip(f"two-host lab unavailable: {why}")
    log_dir = tmp_path_factory.mktemp("two-hosts")
    ref = reference(BLOCK, log_dir)
    mc_env = {"MC_MIN_RPC_PORT": str(MC_MIN), "MC_MAX_RPC_PORT": str(MC_MAX), "HOST": "0.0.0.0"}
    net = netns.TwoHostNet()
    with net:
        # The firewall recipe for the engine ports (see the module docstring).
        net.kv_only(net.b, MC_MIN, MC_MAX, peers=[netns.KV_A])
        net.kv_only(net.a, MC_MIN, MC_MAX, peers=[])
        common = {"block_size": BLOCK, "model_dir": MODEL_DIR, "env": mc_env}
        p = vllm_child(
            "prefill",
            "prefill",
            P_PORT,
            log_dir,
            core=0,
            **common,
            kv=kv_config(
                "prefill",
                SIDE,
                host=netns.KV_A,
                bind_host=netns.KV_A,
                expiry_s=EXPIRY_S,
                failed_push_hold_s=HOLD_S,
            ),
        )
        # No prefix cache on the decoder: every request transfers (or, failing, recomputes)
        # its whole prompt, so repeated prompts stay comparable with the reference.
        d = vllm_child(
            "decode",
            "decode",
            D_PORT,
            log_dir,
            core=1,
            prefix_caching=False,
            **common,
            kv=kv_config("decode", SIDE, host=netns.KV_B, pull_timeout_s=PULL_TIMEOUT_S),
        )
        x = Child(
            name="proxy",
            argv=[
                sys.executable,
                "-m",
                "proxy",
                "--host",
                netns.FRONT_A_X,
                "--port",
                str(X_PORT),
                "--prefill",
                f"http://{netns.FRONT_A}:{P_PORT}",
                "--decode",
                f"http://{netns.FRONT_B}:{D_PORT}",
                "--wait-backends",
                "300",
            ],
            env={**p.env, "PYTHONPATH": str(ROOT)},
            log_path=log_dir / "proxy.log",
            url="",
        )
        for child, ns in ((p, net.a), (d, net.b), (x, net.x)):
            child.argv = net.wrap(ns, child.argv)
        lab = Lab(net, p, d, x, ref, log_dir)
        children = (p, d, x)
        try:
            for c in children:
                c.start()
            deadline = time.monotonic() + 300
            while True:
                dead = [c for c in children if not c.alive()]
                assert not dead, f"{dead[0].name} exited:\n{dead[0].log_tail()}"
                if not lab.client(
                    {
                        "cmd": "wait",
                        "urls": [f"http://{netns.FRONT_A_X}:{X_PORT}/health"],
                        "timeout": 5,
                    }
                )["not_ready"]:
                    break
                assert time.monotonic() < deadline, "two-host lab not ready in 300 s"
            yield lab
        finally:
            for c in reversed(children):
                c.stop()


def test_equivalent_across_hosts_and_kv_uses_the_kv_network(lab: Lab):
    names = list(completion_cases(BLOCK))
    before = lab.sources()
    for stream in (False, True):
        got = lab.complete(names, stream=stream)
        for n in names:
            assert got[n]["status"] == 200, got[n]["error"]
            assert got[n]["ids"] == lab.ref[n], n
    after = lab.sources()
    assert after["local_compute"] - before["local_compute"] == 0
    transferred = after["external_kv_transfer"] - before["external_kv_transfer"]
    assert transferred == 2 * sum(prompt_len(n, BLOCK) for n in names)
    p_log = (lab.log_dir / "prefill.log").read_text()
    assert f"KV side channel listening on tcp://{netns.KV_A}:{SIDE}" in p_log
    pushes = re.findall(r"pushed \d+ blocks .* to (\S+)$", p_log, re.M)
    assert pushes and all(dst.startswith(netns.KV_B + ":") for dst in pushes), pushes


def test_front_host_cannot_reach_the_mooncake_ports_while_kv_flows(lab: Lab):
    """Both instances' engine ports, as they really listen (on every interface), probed
    from the front host: refused, also when it routes the KV subnet through the decode
    host's front address. Without the recipe they would be open (checked, then restored).
    Meanwhile a request still crosses over the KV network."""
    engine_ports = {
        ns: lab.net.listening_ports(ns, MC_MIN, MC_MAX) for ns in (lab.net.a, lab.net.b)
    }
    assert all(len(p) >= 2 for p in engine_ports.values()), engine_ports  # handshake + data
    warning = "mooncake engine listens on more than the KV address"
    for log in ("prefill.log", "decode.log"):  # the operator is told, with the ports
        assert warning in (lab.log_dir / log).read_text(), log
    a_ports, b_ports = engine_ports[lab.net.a], engine_ports[lab.net.b]
    targets = [[netns.FRONT_A, p] for p in a_ports] + [[netns.FRONT_B, p] for p in b_ports]
    targets += [[netns.KV_B, p] for p in b_ports]  # reached via the route added below

    def probe(extra: list[list] | None = None) -> dict[str, str]:
        cmd = {"cmd": "connect", "targets": targets + (extra or []), "timeout": 1.0}
        return lab.client(cmd, timeout=120)

    lab.net.route(lab.net.x, netns.KV_NET, netns.FRONT_B)
    try:
        t0 = time.monotonic()
        got = probe([[netns.FRONT_B, D_PORT]])
        elapsed = time.monotonic() - t0
        assert got.pop(f"{netns.FRONT_B}:{D_PORT}") == "open"  # the probe itself works
        assert set(got.values()) <= {"refused", "timeout"}, got
        assert elapsed < 2 + 1.0 * len(targets), elapsed  # quick: resets, not hangs
        # The recipe is what protects them: without it the front host gets in.
        lab.net.kv_open(lab.net.b)
        try:
            opened = probe()
        finally:
            lab.net.kv_only(lab.net.b, MC_MIN, MC_MAX, peers=[netns.KV_A])
        assert {opened[f"{netns.FRONT_B}:{p}"] for p in b_ports} == {"open"}, opened
        assert {opened[f"{netns.KV_B}:{p}"] for p in b_ports} == {"open"}, opened
    finally:
        lab.net.unroute(lab.net.x, netns.KV_NET)

    before = lab.sources()
    got = lab.complete(["several_blocks"])["several_blocks"]
    assert got["status"] == 200, got["error"]
    assert got["ids"] == lab.ref["several_blocks"]
    after = lab.sources()
    assert after["local_compute"] == before["local_compute"]
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == prompt_len(
        "several_blocks", BLOCK
    )


def test_blocked_side_channel_fails_within_the_pull_timeout_and_frees(lab: Lab):
    lab.net.block_tcp_ports(lab.net.a, SIDE, SIDE)
    try:
        before = lab.sources()
        got = lab.complete(["several_blocks"])["several_blocks"]
    finally:
        lab.net.unblock(lab.net.a)
    assert got["status"] == 200, got["error"]
    assert got["ids"] == lab.ref["several_blocks"]
    assert got["elapsed"] < PULL_TIMEOUT_S + 15
    # The decoder recomputed the prompt instead of decoding from unwritten blocks.
    recomputed = lab.sources()["local_compute"] - before["local_compute"]
    assert recomputed == prompt_len("several_blocks", BLOCK)
    d_log = (lab.log_dir / "decode.log").read_text()
    side = re.escape(f"tcp://{netns.KV_A}:{SIDE}")
    # The block rejects connections: the decoder sees them refused or closed and gives up
    # in about a second; a silently dropped path ends by the pull timeout. Both bounded.
    assert re.search(
        rf"pull from {side} failed: (no reply .*within|side channel {side} not reachable within"
        rf"|prefiller at {side} is unreachable|prefiller at {side} closed the side channel)",
        d_log,
    ), d_log[-3000:]
    # The prefiller's held blocks are freed (by expiry, or at once if the pull arrives
    # after the decoder's deadline and is refused): nothing stays held.
    assert_no_blocks_held(lab, timeout=EXPIRY_S + 15)
    p_log = (lab.log_dir / "prefill.log").read_text()
    assert "no decoder asked for within" in p_log or "after the decoder's deadline" in p_log


def test_blocked_transfer_port_fails_fast_and_frees(lab: Lab):
    lab.net.block_tcp_ports(lab.net.b, MC_MIN, MC_MAX)
    try:
        before = lab.sources()
        got = lab.complete(["longest"])["longest"]
    finally:
        lab.net.unblock(lab.net.b)
    assert got["status"] == 200, got["error"]
    assert got["ids"] == lab.ref["longest"]
    assert got["elapsed"] < PULL_TIMEOUT_S  # the push failed at once and said so
    recomputed = lab.sources()["local_compute"] - before["local_compute"]
    assert recomputed == prompt_len("longest", BLOCK)
    assert re.search(r"transfer \S+ to \S+ failed: ", (lab.log_dir / "prefill.log").read_text())
    assert re.search(r"pull from \S+ failed: ", (lab.log_dir / "decode.log").read_text())
    assert_no_blocks_held(lab, timeout=10 + HOLD_S)


def assert_no_blocks_held(lab: Lab, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        usage = [
            kv_usage(lab.metrics(netns.FRONT_A, P_PORT)),
            kv_usage(lab.metrics(netns.FRONT_B, D_PORT)),
        ]
        if usage == [0.0, 0.0] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert usage == [0.0, 0.0], f"KV blocks still in use (prefill, decode): {usage}"
