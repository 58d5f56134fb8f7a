"""Start, watch and stop a local P/D lab: vLLM instances and the proxy, as child processes.

Used by the demo and the end-to-end tests. Every process is started in its own session
and stopped by its own PID (never by name); every wait has a deadline and also checks
that the process is still alive, since a dying vLLM answers /health with 503 for a
while before it exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "models" / "tiny-llama"
CONFIGS = ROOT / "configs"


_PICK = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now and that the OS will not hand out as an ephemeral port.

    The port is bound later, often by another process: one from the OS's ephemeral range
    can meanwhile become some other socket's local port (seen: a vLLM instance's side
    channel lost its port to another process's outgoing connection). So pick below that
    range, and above the Mooncake engine's default port range (15000-17000).
    """
    low, high = 20000, _ephemeral_low() - 1
    for _ in range(200):
        port = _PICK.randint(low, high) if high > low else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1") -> int:
    """A base port with ``n`` consecutive free ports (a TP>1 prefiller's side channels)."""
    for _ in range(200):
        base = free_port(host)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def kv_config(role: str, side_channel_port: int, **extra: object) -> dict[str, object]:
    """The CPU lab's kv-transfer config for ``role`` with a given side-channel port."""
    cfg = json.loads((CONFIGS / f"kv-{role}-cpu.json").read_text())
    cfg["kv_connector_extra_config"] = {
        "protocol": "tcp",
        "host": "127.0.0.1",
        **cfg["kv_connector_extra_config"],
        "side_channel_port": side_channel_port,
        **extra,
    }
    return cfg


class ProcessDied(RuntimeError):
    pass


@dataclass
class Child:
    """A supervised child process with its log file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    url: str
    # python -m puts the working directory first on sys.path: it decides which tree runs.
    cwd: Path = ROOT
    # What "ready" means: vLLM's /health; for the proxy, /ready (it sees a healthy P and D).
    ready_path: str = "/health"
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_after_s: float | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.cwd,
            start_new_session=True,
        )
        log.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                if not self.alive():
                    code = self.proc.returncode if self.proc else None
                    raise ProcessDied(
                        f"{self.name} exited (code {code}) before it was ready; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(self.url + self.ready_path).status_code == 200:
                        self.ready_after_s = time.monotonic() - self.started_at
                        return self.ready_after_s
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{self.name} not ready after {timeout_s:g}s; log {self.log_path}:\n"
                        f"{self.log_tail()}"
                    )
                time.sleep(0.5)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the child so it shuts its own workers down; SIGKILL its group after grace_s."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        # Whatever the child left behind in its own session (e.g. an engine core).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(5)


def vllm_child(
    name: str,
    role: str,
    port: int,
    log_dir: Path,
    *,
    kv: dict[str, object] | None = None,
    core: int | None = None,
    block_size: int = 32,
    prefix_caching: bool = True,
    model_dir: Path = DEFAULT_MODEL,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Child:
    """A vLLM instance launched through scripts/launch_vllm.sh (what operators run)."""
    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env["MODEL_DIR"] = str(model_dir)
    child_env["BLOCK_SIZE"] = str(block_size)
    child_env["VENV"] = sys.prefix
    if core is not None:
        child_env["CPU_CORE"] = str(core)
    if kv is not None:
        fd, path = tempfile.mkstemp(prefix=f"kv-{name}-", suffix=".json", dir=log_dir)
        with os.fdopen(fd, "w") as f:
            json.dump(kv, f)
        child_env["KV_CONFIG"] = path
    args = list(extra_args)
    if not prefix_caching:
        args.append("--no-enable-prefix-caching")
    return Child(
        name=name,
        argv=["bash", str(ROOT / "scripts" / "launch_vllm.sh"), role, str(port), *args],
        env=child_env,
        log_path=log_dir / f"{name}.log",
        url=f"http://127.0.0.1:{port}",
    )


def proxy_child(
    port: int, prefill: Sequence[str], decode: Sequence[str], log_dir: Path, *extra: str
) -> Child:
    argv = [sys.executable, "-m", "proxy", "--port", str(port)]
    for url in prefill:
        argv += ["--prefill", url]
    for url in decode:
        argv += ["--decode", url]
    return Child(
        name="proxy",
        argv=[*argv, *extra],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        log_path=log_dir / "proxy.log",
        url=f"http://127.0.0.1:{port}",
        ready_path="/ready",
    )


@dataclass
class Lab:
    """A set of children started together and always stopped together."""

    children: list[Child] = field(default_factory=list)

    def start_all(
        self, timeout_s: float = 240.0, progress: Callable[[str], None] | None = None
    ) -> None:
        for c in self.children:
            c.start()
            if progress:
                progress(f"started {c.name} (pid {c.pid}) -> {c.url}, log {c.log_path}")
        for c in self.children:
            took = c.wait_ready(timeout_s)
            if progress:
                progress(f"{c.name} ready after {took:.1f}s")

    def stop_all(self) -> None:
        for c in reversed(self.children):
            c.stop()

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


@dataclass
class PdStack:
    """1P1D + proxy as one lab: the shape the demo, the A/B script and the e2e tests run."""

    lab: Lab
    prefill: Child
    decode: Child
    proxy: Child


def pd_stack(
    log_dir: Path,
    *,
    block_size: int = 32,
    model_dir: Path = DEFAULT_MODEL,
    decoder_prefix_caching: bool = True,
    ports: tuple[int, int, int] | None = None,
    side_channel_port: int | None = None,
) -> PdStack:
    """Prefill on core 0, decode on core 1, our proxy in front; ``ports`` = (P, D, proxy)."""
    p_port, d_port, x_port = ports or (free_port(), free_port(), free_port())
    common = {"block_size": block_size, "model_dir": model_dir}
    prefill = vllm_child(
        "prefill",
        "prefill",
        p_port,
        log_dir,
        core=0,
        **common,
        kv=kv_config("prefill", side_channel_port or free_port()),
    )
    decode = vllm_child(
        "decode",
        "decode",
        d_port,
        log_dir,
        core=1,
        prefix_caching=decoder_prefix_caching,
        **common,
        kv=kv_config("decode", free_port()),
    )
    proxy = proxy_child(x_port, [prefill.url], [decode.url], log_dir)
    return PdStack(Lab([prefill, decode, proxy]), prefill, decode, proxy)


def prompt_tokens_by_source(metrics_text: str) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source_total`` per source, from a /metrics page."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            labels, value = line.rsplit(" ", 1)
            source = labels.split('source="', 1)[1].split('"', 1)[0]
            out[source] = out.get(source, 0.0) + float(value)
    return out
