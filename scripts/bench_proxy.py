"""The proxy's own overhead: the same load straight to a fast FAKE decoder vs through a proxy.

    python -m scripts.bench_proxy [--reps 3] [--c1-requests 400] [--c64-seconds 4]
                                  [--targets direct,ours,vllm-router] [--json out.json]

Backends are FAKE vLLM instances (raw asyncio + httptools, one process, uvloop) that
answer in well under a millisecond and check the P/D protocol: a prefill request must be
one token, not streamed, with ``kv_transfer_params.do_remote_decode``; a decode request
must carry the ``kv_transfer_params`` (transfer id) that the fake prefiller issued, each
used once. The decoder streams 16 SSE chunks. The load client is another process (raw
asyncio + httptools, keep-alive connections) so that it costs the same for every target.

Per target and repetition (targets interleaved, repetitions back to back): time to first
body byte at concurrency 1 (sequential requests), streamed requests/s at concurrency 64
(closed loop, bounded in time and count), and the target process's CPU time per request
(/proc/PID/stat over the c=64 phase). Medians over repetitions; ratios against the
decoder called directly and against vLLM's Rust router (``vllm-router``, P/D mode).
Every child is started in its own session and stopped by its PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHUNKS = 16
TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- FAKE backends ----------------------------------------------------------------------


def _http(status: int, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
        % (status, ctype, len(body))
        + body
    )


_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
_SSE_EVENT = (
    b'data: {"id":"cmpl-fake","object":"text_completion","choices":[{"index":0,"text":"%s%d"}]}\n\n'
)


def _sse_response(text: str) -> bytes:
    out = [_SSE_HEAD]
    for i in range(CHUNKS):
        ev = _SSE_EVENT % (text.encode(), i)
        out.append(b"%x\r\n%s\r\n" % (len(ev), ev))
    done = b"data: [DONE]\n\n"
    out.append(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
    return b"".join(out)


class FakeState:
    def __init__(self) -> None:
        self.issued: set[str] = set()
        self.stats = {"prefill": 0, "decode": 0, "decode_no_kv": 0, "violations": 0}
        self.last_violation = ""

    def violation(self, why: str) -> None:
        self.stats["violations"] += 1
        self.last_violation = why


class FakeProto(asyncio.Protocol):
    """FAKE vLLM: just enough HTTP/1.1 (keep-alive) for the benchmark."""

    def __init__(self, role: str, state: FakeState) -> None:
        import httptools

        self.role, self.state = role, state
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception:
            if self.transport:
                self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        path = self.url.split(b"?", 1)[0]
        if path == b"/health":
            self.transport.write(_http(200, b""))
        elif path == b"/stats":
            self.transport.write(_http(200, json.dumps(self.state.stats).encode()))
        elif path == b"/v1/models":
            self.transport.write(
                _http(200, b'{"object":"list","data":[{"id":"fake","object":"model"}]}')
            )
        elif path in (b"/v1/completions", b"/v1/chat/completions"):
            self.transport.write(self._complete(json.loads(b"".join(self.body))))
        else:
            self.transport.write(_http(404, b'{"error":"not found"}'))

    def _complete(self, body: dict) -> bytes:
        st = self.state
        kv = body.get("kv_transfer_params")
        if self.role == "prefill":
            st.stats["prefill"] += 1
            if not (isinstance(kv, dict) and kv.get("do_remote_decode")):
                st.violation("prefill without do_remote_decode")
            if body.get("max_tokens", body.get("max_completion_tokens")) != 1:
                st.violation("prefill max_tokens != 1")
            if body.get("stream"):
                st.violation("prefill streamed")
            tid = uuid.uuid4().hex
            st.issued.add(tid)
            out = {
                "id": "cmpl-fake",
                "object": "text_completion",
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 50, "completion_tokens": 1, "total_tokens": 51},
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_host": "127.0.0.1",
                    "remote_port": 1,
                    "remote_engine_id": "fake",
                    "remote_block_ids": [1, 2],
                    "transfer_id": tid,
                    "transfer_secret": "s",
                },
            }
            return _http(200, json.dumps(out).encode())
        st.stats["decode"] += 1
        if kv is None:
            st.stats["decode_no_kv"] += 1
        elif not isinstance(kv, dict) or kv.get("transfer_id") not in st.issued:
            st.violation("decode with unknown or reused kv_transfer_params")
        else:
            st.issued.discard(kv["transfer_id"])
        if body.get("stream"):
            return _sse_response("tok")
        return _http(
            200,
            b'{"id":"cmpl-fake","object":"text_completion","choices":[{"index":0,"text":"t"}]}',
        )


async def run_fakes(p_port: int, d_port: int) -> None:
    loop = asyncio.get_running_loop()
    state = FakeState()
    servers = [
        await loop.create_server(lambda: FakeProto("prefill", state), "127.0.0.1", p_port),
        await loop.create_server(lambda: FakeProto("decode", state), "127.0.0.1", d_port),
    ]
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for s in servers:
        s.close()


# -- load client ------------------------------------------------------------------------


class ClientConn(asyncio.Protocol):
    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.fut: asyncio.Future | None = None
        self.first: float | None = None
        self.nbytes = 0
        self.lost = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.lost = True
        if self.fut and not self.fut.done():
            self.fut.set_exception(ConnectionError("closed"))

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        self.nbytes += len(body)

    def on_message_complete(self) -> None:
        if self.fut and not self.fut.done():
            self.fut.set_result((self.parser.get_status_code(), self.first, self.nbytes))

    async def request(self, raw: bytes):
        assert self.transport is not None
        self.first, self.nbytes = None, 0
        self.fut = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.fut


def request_bytes(port: int) -> bytes:
    body = json.dumps(
        {
            "model": "fake",
            "prompt": "The quick brown fox jumps over the lazy dog. " * 5,
            "max_tokens": CHUNKS,
            "stream": True,
        }
    ).encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % (port, len(body))
    ) + body


async def _connect(port: int) -> ClientConn:
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(ClientConn, "127.0.0.1", port)
    return proto


async def load(port: int, concurrency: int, max_requests: int, max_seconds: float) -> dict:
    raw = request_bytes(port)
    conns = [await _connect(port) for _ in range(concurrency)]
    ttfb: list[float] = []
    errors = 0
    done = 0
    t_end = time.perf_counter() + max_seconds

    async def worker(i: int) -> None:
        nonlocal errors, done
        conn = conns[i]
        while done < max_requests and time.perf_counter() < t_end:
            done += 1
            t0 = time.perf_counter()
            try:
                status, first, nbytes = await asyncio.wait_for(conn.request(raw), 30)
            except (ConnectionError, TimeoutError):
                errors += 1
                conn = conns[i] = await _connect(port)
                continue
            if status != 200 or first is None or nbytes < 100:
                errors += 1
            else:
                ttfb.append(first - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    wall = time.perf_counter() - t0
    for c in conns:
        if c.transport:
            c.transport.close()
    ttfb.sort()
    return {
        "ok": len(ttfb),
        "errors": errors,
        "wall_s": wall,
        "rps": len(ttfb) / wall if wall else 0.0,
        "p50_ms": statistics.median(ttfb) * 1e3 if ttfb else float("nan"),
        "p99_ms": ttfb[min(len(ttfb) - 1, int(len(ttfb) * 0.99))] * 1e3 if ttfb else float("nan"),
    }


# -- orchestration ----------------------------------------------------------------------


class Proc:
    def __init__(self, name: str, argv: list[str], log: Path) -> None:
        self.name = name
        with log.open("wb") as f:
            self.p = subprocess.Popen(
                argv,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.p.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.p.wait(10)
        if self.p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(5)


def wait_http(port: int, path: str, timeout_s: float, proc: Proc | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    req = f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode()
    while time.monotonic() < deadline:
        if proc is not None and proc.p.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.p.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1) as s:
            s.sendall(req)
            if s.recv(64).startswith(b"HTTP/1.1 200"):
                return
        time.sleep(0.1)
    raise TimeoutError(f"port {port}{path} not ready after {timeout_s}s")


def fake_stats(port: int) -> dict:
    with socket.create_connection(("127.0.0.1", port), 2) as s:
        s.sendall(b"GET /stats HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head, body = data.split(b"\r\n\r\n", 1)
        length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
        while len(body) < length:
            body += s.recv(65536)
    return json.loads(body)


def start_target(name: str, p_url: str, d_url: str, log_dir: Path) -> tuple[Proc | None, int]:
    if name == "direct":
        return None, int(d_url.rsplit(":", 1)[1])
    port = free_port()
    if name == "ours":
        argv = [
            sys.executable,
            "-m",
            "proxy",
            "--port",
            str(port),
            "--prefill",
            p_url,
            "--decode",
            d_url,
            "--log-level",
            "warning",
        ]
    elif name == "vllm-router":
        exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
        if exe is None:
            raise RuntimeError("vllm-router is not installed in this venv")
        argv = [
            exe,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--vllm-pd-disaggregation",
            "--prefill",
            p_url,
            "--decode",
            d_url,
            "--prometheus-port",
            str(free_port()),
            "--prometheus-host",
            "127.0.0.1",
            "--log-level",
            "warning",
        ]
    else:
        raise ValueError(name)
    proc = Proc(name, argv, log_dir / f"{name}.log")
    wait_http(port, "/health", 60, proc)
    return proc, port


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--c1-requests", type=int, default=400)
    ap.add_argument("--c64-seconds", type=float, default=4.0)
    ap.add_argument("--c64-max-requests", type=int, default=40000)
    ap.add_argument("--targets", default="direct,ours,vllm-router")
    ap.add_argument("--log-dir", default="/tmp/bench_proxy")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--role", help=argparse.SUPPRESS)  # internal: fakes | load
    ap.add_argument("--ports", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    import uvloop

    if a.role == "fakes":
        p, d = map(int, a.ports.split(","))
        uvloop.run(run_fakes(p, d))
        return
    if a.role == "load":
        port, conc, n, secs = a.ports.split(",")
        res = uvloop.run(load(int(port), int(conc), int(n), float(secs)))
        print(json.dumps(res))
        return

    log_dir = Path(a.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    targets = [t for t in a.targets.split(",") if t]
    p_port, d_port = free_port(), free_port()
    me = [sys.executable, "-m", "scripts.bench_proxy"]
    fakes = Proc(
        "fakes", [*me, "--role", "fakes", "--ports", f"{p_port},{d_port}"], log_dir / "fakes.log"
    )
    procs: dict[str, Proc | None] = {}
    results: dict[str, list[dict]] = {t: [] for t in targets}
    load_avg_before = os.getloadavg()
    try:
        wait_http(d_port, "/health", 20, fakes)
        p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        ports = {}
        for t in targets:
            procs[t], ports[t] = start_target(t, p_url, d_url, log_dir)

        def run_load(t: str, conc: int, n: int, secs: float) -> dict:
            out = subprocess.run(
                [*me, "--role", "load", "--ports", f"{ports[t]},{conc},{n},{secs}"],
                capture_output=True,
                text=True,
                timeout=secs + 120,
                cwd=ROOT,
            )
            if out.returncode != 0:
                raise RuntimeError(f"load client failed: {out.stderr[-2000:]}")
            return json.loads(out.stdout.strip().splitlines()[-1])

        for t in targets:  # warm up: connections, caches, JIT-free but pools filled
            run_load(t, 8, 300, 10)
        for rep in range(a.reps):
            for t in targets:
                before = fake_stats(d_port)
                c1 = run_load(t, 1, a.c1_requests, 60)
                proc = procs[t]
                cpu0 = proc.cpu_s() if proc else 0.0
                c64 = run_load(t, 64, a.c64_max_requests, a.c64_seconds)
                cpu = (proc.cpu_s() - cpu0) if proc else float("nan")
                after = fake_stats(d_port)
                row = {
                    "rep": rep,
                    "c1_p50_ms": c1["p50_ms"],
                    "c1_p99_ms": c1["p99_ms"],
                    "c64_rps": c64["rps"],
                    "cpu_us_per_req": cpu / max(1, c64["ok"]) * 1e6,
                    "errors": c1["errors"] + c64["errors"],
                    "violations": after["violations"] - before["violations"],
                    "decode_no_kv": after["decode_no_kv"] - before["decode_no_kv"],
                }
                results[t].append(row)
                print(f"[rep {rep}] {t:12s} {json.dumps(row)}", flush=True)
    finally:
        for p in procs.values():
            if p is not None:
                p.stop()
        fakes.stop()
    load_avg_after = os.getloadavg()
    report(results, load_avg_before, load_avg_after)
    if a.json:
        Path(a.json).write_text(
            json.dumps({"results": results, "loadavg": [load_avg_before, load_avg_after]}, indent=1)
        )


def report(results: dict[str, list[dict]], before, after) -> None:
    med = {
        t: {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "rep"}
        for t, rows in results.items()
        if rows
    }
    direct = med.get("direct")
    print(f"\nload average before {before[0]:.2f}, after {after[0]:.2f} (2 cores, shared)")
    hdr = (
        f"{'target':12s} {'TTFB p50':>9s} {'p99':>8s} {'added p50':>10s} {'added p99':>10s} "
        f"{'req/s c64':>10s} {'CPU us/req':>11s} {'errors':>7s} {'viol.':>6s} {'no kv':>6s}"
    )
    print(hdr)
    for t, m in med.items():
        add50 = m["c1_p50_ms"] - direct["c1_p50_ms"] if direct and t != "direct" else 0.0
        add99 = m["c1_p99_ms"] - direct["c1_p99_ms"] if direct and t != "direct" else 0.0
        print(
            f"{t:12s} {m['c1_p50_ms']:8.3f}m {m['c1_p99_ms']:7.3f}m {add50:9.3f}m {add99:9.3f}m "
            f"{m['c64_rps']:10.0f} {m['cpu_us_per_req']:11.0f} {m['errors']:7.0f} "
            f"{m['violations']:6.0f} {m['decode_no_kv']:6.0f}"
        )
    if "ours" in med and "vllm-router" in med and direct:
        o, r = med["ours"], med["vllm-router"]
        ao, ar = o["c1_p50_ms"] - direct["c1_p50_ms"], r["c1_p50_ms"] - direct["c1_p50_ms"]
        print(
            f"\nours / vllm-router: added TTFB p50 {ao / ar if ar > 0 else float('nan'):.2f}x, "
            f"req/s {o['c64_rps'] / r['c64_rps']:.2f}x, "
            f"CPU per request {o['cpu_us_per_req'] / r['cpu_us_per_req']:.2f}x"
        )
        print(
            f"ours / direct req/s: {o['c64_rps'] / direct['c64_rps']:.2f}; "
            f"vllm-router / direct: {r['c64_rps'] / direct['c64_rps']:.2f}"
        )


if __name__ == "__main__":
    main()
