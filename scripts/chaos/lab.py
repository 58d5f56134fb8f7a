"""2P2D + proxy for the soak: in the two-host namespace lab when it can run (prefillers
on host A, decoders on host B, proxy and this process on host X), else on loopback.

Everything is started through scripts/pdlab.py (launch_vllm.sh, by PID, own session) and
stopped by PID. In the namespace lab this process moves itself into host X (setns) right
after creating the namespaces, so its HTTP traffic only reaches addresses of namespaces it
created; the host's network is never touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from scripts import netns
from scripts.pdlab import DEFAULT_MODEL, ROOT, Child, free_port, kv_config, vllm_child

CLONE_NEWNET = 0x40000000
MC_MIN, MC_MAX = 15100, 15163
ADMIN_KEY = "chaos-admin-key"


@dataclass
class Instance:
    name: str
    role: str
    index: int
    child: Child
    url: str  # as the proxy (and this process) reach it
    side_channel: int
    ns: str | None
    incarnation: int = 1

    def restart(self) -> None:
        """Start a new incarnation; the previous one's log is kept as NAME.N.log."""
        log = self.child.log_path
        if log.exists():
            log.rename(log.with_name(f"{self.name}.{self.incarnation}.log"))
        self.child.start()
        self.incarnation += 1


@dataclass
class SoakLab:
    log_dir: Path
    netns: netns.TwoHostNet | None
    instances: list[Instance]
    proxy: Child
    proxy_url: str
    notes: list[str] = field(default_factory=list)

    def by_role(self, role: str) -> list[Instance]:
        return [i for i in self.instances if i.role == role]

    def children(self) -> list[Child]:
        return [*(i.child for i in self.instances), self.proxy]

    def wait_ready(self, timeout_s: float, progress=print) -> None:  # type: ignore[no-untyped-def]
        """Every instance's /health, then the proxy's /ready; processes must stay alive."""
        deadline = time.monotonic() + timeout_s
        pending = [*(i.child for i in self.instances), self.proxy]
        with httpx.Client(timeout=3.0) as c:
            while pending:
                for ch in list(pending):
                    if not ch.alive():
                        raise RuntimeError(f"{ch.name} exited:\n{ch.log_tail()}")
                    try:
                        if c.get(ch.url + ch.ready_path).status_code == 200:
                            pending.remove(ch)
                            progress(
                                f"{ch.name} ready after {time.monotonic() - ch.started_at:.1f}s"
                            )
                    except httpx.HTTPError:
                        pass
                if pending and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"not ready after {timeout_s:g}s: {[c.name for c in pending]}"
                    )
                if pending:
                    time.sleep(1.0)

    def stop(self) -> None:
        for ch in reversed(self.children()):
            with contextlib.suppress(Exception):
                ch.stop(grace_s=10)
        if self.netns is not None:
            self.netns.close()


def enter_netns(name: str) -> None:
    """Move this (still single-threaded) process into namespace ``name``."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def build(
    log_dir: Path,
    *,
    use_netns: bool,
    expiry_s: float,
    pull_timeout_s: float,
    proxy_args: list[str],
    lean: bool = True,
    model_dir: Path = DEFAULT_MODEL,
    block_size: int = 32,
) -> SoakLab:
    """Create (not start) the lab. P0 and D1 on core 0, P1 and D0 on core 1."""
    log_dir.mkdir(parents=True, exist_ok=True)
    net: netns.TwoHostNet | None = None
    if use_netns:
        net = netns.TwoHostNet()
        net.open()
        # The operator's firewall recipe for the engine ports, as the two-host e2e runs it.
        net.kv_only(net.b, MC_MIN, MC_MAX, peers=[netns.KV_A])
        net.kv_only(net.a, MC_MIN, MC_MAX, peers=[])
        # The proxy releases held KV on the prefillers' side channels (their KV address).
        net.route(net.x, f"{netns.KV_A}/32", netns.FRONT_A)
        enter_netns(net.x)
    env: dict[str, str] = {"MAX_NUM_SEQS": "8", "MAX_MODEL_LEN": "1024"}
    if lean:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if net is not None:
        env |= {"MC_MIN_RPC_PORT": str(MC_MIN), "MC_MAX_RPC_PORT": str(MC_MAX), "HOST": "0.0.0.0"}
    instances: list[Instance] = []
    cores = {("prefill", 0): 0, ("prefill", 1): 1, ("decode", 0): 1, ("decode", 1): 0}
    for role in ("prefill", "decode"):
        for idx in range(2):
            name = f"{role[0].upper()}{idx}"
            port = 8100 + idx if net else free_port()
            side = 17100 + idx if role == "prefill" and net else free_port()
            extra: dict[str, object] = {"expiry_s": expiry_s, "pull_timeout_s": pull_timeout_s}
            if net is not None:
                host = netns.KV_A if role == "prefill" else netns.KV_B
                extra |= {"host": host}
                if role == "prefill":
                    extra |= {"bind_host": "0.0.0.0"}
                if role == "decode":
                    port = 8200 + idx
            child = vllm_child(
                name,
                role,
                port,
                log_dir,
                core=cores[(role, idx)],
                block_size=block_size,
                model_dir=model_dir,
                kv=kv_config(role, side, **extra),
                env=env,
            )
            if net is not None:
                ns = net.a if role == "prefill" else net.b
                front = netns.FRONT_A if role == "prefill" else netns.FRONT_B
                child.argv = net.wrap(ns, child.argv)
                child.url = f"http://{front}:{port}"
            else:
                ns = None
            instances.append(Instance(name, role, idx, child, child.url, side, ns))
    x_host = netns.FRONT_A_X if net else "127.0.0.1"
    x_port = 8000 if net else free_port()
    argv = [sys.executable, "-m", "proxy", "--host", x_host, "--port", str(x_port)]
    for inst in instances:
        argv += [f"--{inst.role}", inst.url]
    proxy = Child(
        name="proxy",
        argv=[*argv, *proxy_args],
        env={**os.environ, "PYTHONPATH": str(ROOT), "PD_PROXY_ADMIN_KEY": ADMIN_KEY},
        log_path=log_dir / "proxy.log",
        url=f"http://{x_host}:{x_port}",
        ready_path="/ready",
    )
    return SoakLab(log_dir, net, instances, proxy, proxy.url)
