"""Issue 10, proxy side: each attack performed against the real proxy over real HTTP (or raw
sockets on 127.0.0.1), with FAKE vLLM backends (tests/fake_vllm.py) to drive exact
failures, and shown refused: a clear OpenAI-style error, nothing stalled or leaked."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest
import zmq

from connector.wire import PullReply, decode_pull, encode
from proxy.logsafe import escape, get_logger, request_id
from proxy.pool import Pool
from proxy.settings import (
    BreakerSettings,
    ClientLimits,
    HealthSettings,
    InstanceSpec,
    ProxySettings,
    Timeouts,
)
from tests.fake_vllm import FakeVllm, fake_malformed_http
from tests.servers import free_port, serve
from tests.unit.proxy.helpers import Running, serve_proxy

NO_HEALTH = HealthSettings(interval_s=0)
BODY = {"model": "m", "prompt": "hello there", "max_tokens": 4}
KV_REQ = {"do_remote_decode": True, "do_remote_prefill": False}


@contextmanager
def stack(n_d: int = 1, **kw) -> Iterator[tuple[Running, FakeVllm, list[FakeVllm]]]:
    """One fake prefiller, n_d fake decoders and a proxy."""
    p = FakeVllm("P")
    ds = [FakeVllm(f"D{i}") for i in range(n_d)]
    with ExitStack() as es:
        p_url = es.enter_context(serve(p.app))
        d_urls = [es.enter_context(serve(d.app)) for d in ds]
        settings = ProxySettings(
            prefill=(p_url,),
            decode=tuple(d_urls),
            timeouts=kw.pop("timeouts", Timeouts(connect_s=2.0)),
            health=kw.pop("health", NO_HEALTH),
            release_timeout_s=kw.pop("release_timeout_s", 0.5),
            **kw,
        )
        yield es.enter_context(serve_proxy(settings)), p, ds


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, value = line.rsplit(" ", 1)
        if head[len(name) :][:1] not in ("{", " ", "") or not head.startswith(name):
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def port_of(px: Running) -> int:
    return int(px.url.rsplit(":", 1)[1])


def log_text(caplog) -> str:
    """Everything the records carry: messages, and any exception text."""
    out = []
    for r in caplog.records:
        out.append(r.getMessage())
        if r.exc_info and r.exc_info[1] is not None:
            out.append(str(r.exc_info[1]))
        if r.exc_text:
            out.append(r.exc_text)
    return "\n".join(out)


def post_raw(body: bytes, headers: dict[str, str] | None = None, path="/v1/completions") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n"
    for k, v in (headers or {}).items():
        head += f"{k}: {v}\r\n"
    return head.encode() + b"content-length: %d\r\n\r\n" % len(body) + body


async def read_until_eof(reader: asyncio.StreamReader, limit_s: float) -> tuple[bytes, float]:
    """All bytes until the proxy closes the connection, and when (bounded by ``limit_s``)."""
    t0 = time.monotonic()
    data = b""
    async with asyncio.timeout(limit_s):
        while chunk := await reader.read(65536):
            data += chunk
    return data, time.monotonic() - t0


def split_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


# -- 2: smuggled transfer fields ------------------------------------------------------------

EVIL = {
    "do_remote_prefill": True,
    "remote_host": "10.6.6.6",
    "remote_port": 1,
    "transfer_id": "victim-transfer",
    "transfer_secret": "stolen-secret",
}
SMUGGLED = {
    "kv_transfer_params": EVIL,
    "ec_transfer_params": EVIL,
    "vllm_xargs": {
        "kv_transfer_params": json.dumps(EVIL),  # vLLM accepts a string here, hands it on
        "ec_transfer_params": json.dumps(EVIL),
        "keep": "me",
    },
}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize(
    ("extra", "settings", "fallback"),
    [
        ({}, {}, None),  # disaggregated: prefill leg, then decode leg with the P's handle
        ({"n": 2}, {}, "n"),
        ({"prompt_logprobs": 1}, {}, "prompt_logprobs"),
        ({}, {"min_prefill_tokens": 10_000}, "short_prompt"),
    ],
)
def test_smuggled_kv_transfer_params_reach_no_backend_on_any_path(
    endpoint, extra, settings, fallback
):
    if endpoint == "chat":
        body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    else:
        body = {"model": "m", "prompt": "hello"}
    with stack(**settings) as (px, p, (d,)):
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        r = httpx.post(px.url + path, json={**body, **SMUGGLED, **extra})
        assert r.status_code == 200
        if fallback:
            assert metric(px.url, "pd_proxy_fallbacks_total", reason=fallback) == 1
    assert len(d.received) == 1 and len(p.received) == (0 if fallback else 1)
    for leg in (*p.received, *d.received):
        sent = leg["body"]
        assert "ec_transfer_params" not in sent
        assert sent["vllm_xargs"] == {"keep": "me"}  # the client's other extension args stay
        text = json.dumps(sent)
        assert "10.6.6.6" not in text and "stolen-secret" not in text and "victim" not in text
    if p.received:
        assert p.received[0]["body"]["kv_transfer_params"] == KV_REQ
    dec_kv = d.received[0]["body"].get("kv_transfer_params")
    assert dec_kv is None if fallback else dec_kv["transfer_id"] == "P-t"


def test_vllm_xargs_that_is_not_an_object_is_refused():
    with stack() as (px, p, (d,)):
        bad = {**BODY, "vllm_xargs": json.dumps({"kv_transfer_params": EVIL})}
        r = httpx.post(px.url + "/v1/completions", json=bad)
        assert r.status_code == 400 and "vllm_xargs" in r.json()["error"]["message"]
    assert p.received == d.received == []


# -- 5: slow readers ------------------------------------------------------------------------


def slow_reader(url: str, rid: str) -> socket.socket:
    """A client that sends a streamed request, reads the status line and stops reading
    (a tiny receive buffer, so the proxy's writes block soon)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(10)
    s.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    body = json.dumps({**BODY, "stream": True}).encode()
    s.sendall(post_raw(body, {"x-request-id": rid}))
    assert s.recv(12) == b"HTTP/1.1 200"
    return s


def long_stream(d: FakeVllm, chunks: int = 2000) -> None:
    d.behavior.update(chunks=chunks, pad=16384)  # up to 32 MB: more than any socket buffer


def test_slow_readers_are_dropped_and_a_normal_client_is_served_breaker_closed():
    limits = ClientLimits(write_timeout_s=1.0)
    timeouts = Timeouts(connect_s=2.0, pool_wait_s=10.0)
    breaker = BreakerSettings(gateway_failures=1, answer_failures=1, open_s=60)
    with stack(max_connections=3, limits=limits, timeouts=timeouts, breaker=breaker) as (
        px,
        _p,
        (d,),
    ):
        long_stream(d)
        slow = [slow_reader(px.url, f"slow-{i}") for i in range(3)]  # every upstream slot
        try:
            t0 = time.monotonic()
            r = httpx.post(px.url + "/v1/completions", json=BODY, timeout=20)
            waited = time.monotonic() - t0
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "D0:4"
            assert 0.5 < waited < 8  # it waited for a slot freed by the write timeout
            assert metric(px.url, "pd_proxy_limit_hits_total", limit="write_timeout") == 3
            assert wait_for(lambda: sorted(d.cancelled) == ["slow-0", "slow-1", "slow-2"])
            assert px.proxy.decode.instances[0].breaker.state == "closed"
            assert metric(px.url, "pd_proxy_upstream_errors_total") == 0
            reqs = "pd_proxy_requests_total"
            assert metric(px.url, reqs, outcome="client_write_timeout") == 3
            assert metric(px.url, "pd_proxy_instance_inflight", role="decode") == 0
        finally:
            for s in slow:
                s.close()


def test_full_upstream_pool_is_503_overloaded_not_a_decoder_failure():
    limits = ClientLimits(write_timeout_s=30.0)
    timeouts = Timeouts(connect_s=2.0, pool_wait_s=0.3)
    breaker = BreakerSettings(gateway_failures=1, answer_failures=1, open_s=60)
    with stack(max_connections=2, limits=limits, timeouts=timeouts, breaker=breaker) as (
        px,
        p,
        (d,),
    ):
        long_stream(d)
        slow = [slow_reader(px.url, f"slow-{i}") for i in range(2)]
        try:
            for _ in range(3):  # before the fix: 502 once, then the breaker's 503 for all
                t0 = time.monotonic()
                r = httpx.post(px.url + "/v1/completions", json=BODY, timeout=20)
                assert time.monotonic() - t0 < 3
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                err = r.json()["error"]
                assert err["code"] == "proxy_overloaded" and "proxy overloaded" in err["message"]
            assert px.proxy.decode.instances[0].breaker.state == "closed"
            assert metric(px.url, "pd_proxy_upstream_errors_total") == 0
            assert metric(px.url, "pd_proxy_limit_hits_total", limit="upstream_pool") == 3
            # The prefiller's held KV was released each time (no decoder took it).
            assert wait_for(lambda: metric(px.url, "pd_proxy_kv_releases_total") == 3)
        finally:
            for s in slow:
                s.close()
        # Once the slow readers are gone, everyone is served again.
        assert wait_for(
            lambda: httpx.post(px.url + "/v1/completions", json=BODY).status_code == 200
        )
        assert len(p.received) >= 4


def test_client_blocking_the_stream_is_not_blamed_on_the_decoder():
    """The proxy is blocked writing to a client that pauses longer than the stream idle
    timeout: not the decoder's silence, so the stream completes."""
    timeouts = Timeouts(connect_s=2.0, idle_s=0.5)
    with stack(limits=ClientLimits(write_timeout_s=30.0), timeouts=timeouts) as (px, _, (d,)):
        long_stream(d, chunks=600)  # ~10 MB
        s = slow_reader(px.url, "pauser")
        try:
            time.sleep(1.5)  # 3x the idle timeout without reading
            data = b""
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not data.endswith(b"\r\n0\r\n\r\n"):
                chunk = s.recv(1 << 20)
                if not chunk:
                    break
                data += chunk
        finally:
            s.close()
        assert b'"error"' not in data and data.count(b"#") == 600 and b"data: [DONE]" in data
        assert metric(px.url, "pd_proxy_upstream_errors_total", kind="idle_timeout") == 0
        assert wait_for(lambda: metric(px.url, "pd_proxy_requests_total", outcome="ok") == 1)


# -- 6: big and deep bodies -----------------------------------------------------------------


async def test_oversize_body_is_413_before_it_is_read():
    limits = ClientLimits(max_body_bytes=1 << 20)
    with stack(limits=limits) as (px, p, (d,)):
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(px))
        head = post_raw(b"")[: -len(b"content-length: 0\r\n\r\n")]
        writer.write(head + b"content-length: %d\r\n\r\n" % (100 << 20) + b'{"prompt": "')
        await writer.drain()
        t0 = time.monotonic()
        data = await asyncio.wait_for(reader.readuntil(b"}}"), 5)
        assert time.monotonic() - t0 < 1.0
        status, headers, body = split_response(data)
        assert status == 413 and headers["connection"] == "close"
        err = json.loads(body)["error"]
        assert err["code"] == "body_too_large" and str(1 << 20) in err["message"]
        writer.close()
        # Without a Content-Length (chunked): refused once the limit is crossed.
        chunks = (b" " * 65536 for _ in range(40))  # 2.5 MiB
        r = httpx.post(px.url + "/v1/completions", content=chunks, timeout=10)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        assert metric(px.url, "pd_proxy_limit_hits_total", limit="body_size") == 2
    assert p.received == d.received == []


def test_health_stays_responsive_while_a_big_body_is_parsed():
    big = json.dumps({"model": "m", "prompt": list(range(6_000_000)), "n": 0}).encode()
    t = time.perf_counter()
    json.loads(big)
    inline_s = time.perf_counter() - t  # what the event loop would have been blocked for
    limits = ClientLimits(max_body_bytes=64 << 20)
    with stack(limits=limits) as (px, p, _):
        # Warm the worker process so the window below is the parse, not its start-up.
        small_big = json.dumps({"model": "m", "prompt": [1] * 100_000, "n": 0}).encode()
        r = httpx.post(px.url + "/v1/completions", content=small_big, timeout=30)
        assert r.status_code == 400
        result: dict[str, httpx.Response] = {}

        def send() -> None:
            result["r"] = httpx.post(px.url + "/v1/completions", content=big, timeout=60)

        sender = threading.Thread(target=send)
        worst = 0.0
        with httpx.Client(timeout=10) as probe:
            sender.start()
            while sender.is_alive():
                t = time.monotonic()
                assert probe.get(px.url + "/health").status_code == 200
                worst = max(worst, time.monotonic() - t)
                time.sleep(0.02)
        sender.join()
        r = result["r"]
        assert r.status_code == 400 and "'n'" in r.json()["error"]["message"]  # it was parsed
    assert p.received == []
    assert worst < inline_s / 3, (worst, inline_s)


@pytest.mark.parametrize("offload", [0, 1024], ids=["inline", "worker"])
def test_deeply_nested_json_is_400_not_500(offload):
    limits = ClientLimits(offload_parse_bytes=offload)
    with stack(limits=limits) as (px, p, _):
        for deep in (
            b"[" * 200_000,
            b'{"prompt": "x", "tools": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            b'{"prompt": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}",
        ):
            r = httpx.post(px.url + "/v1/completions", content=deep, timeout=30)
            assert r.status_code == 400, r.text
            assert "nested too deeply" in r.json()["error"]["message"]
        assert metric(px.url, "pd_proxy_requests_total", outcome="bad_request") == 3
    assert p.received == []


# -- 7: slowloris ---------------------------------------------------------------------------


async def test_partial_headers_are_closed_after_the_header_timeout():
    with stack(limits=ClientLimits(header_timeout_s=0.5)) as (px, _, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(px))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: proxy\r\n")  # never finished
        data, took = await read_until_eof(reader, 5)
        assert data == b"" and 0.4 < took < 2.0
        writer.close()
        # Trickling a byte at a time does not extend the deadline.
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(px))
        t0 = time.monotonic()
        for b in b"GET /health HTTP/1.1\r\nx-pad: " + b"a" * 200:
            if reader.at_eof() or writer.is_closing():
                break
            writer.write(bytes([b]))
            await asyncio.sleep(0.05)
            if time.monotonic() - t0 > 3:
                break
        data, _ = await read_until_eof(reader, 5)
        assert data == b"" and time.monotonic() - t0 < 2.0
        writer.close()
        assert metric(px.url, "pd_proxy_limit_hits_total", limit="header_timeout") == 2


async def test_kept_alive_connection_idles_but_its_next_request_has_a_header_deadline():
    limits = ClientLimits(header_timeout_s=0.5, keepalive_timeout_s=2.5)
    with stack(limits=limits) as (px, _, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(px))
        writer.write(b"GET /health HTTP/1.1\r\nhost: proxy\r\n\r\n")
        assert (await reader.readuntil(b'{"status": "ok"}')).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(1.0)  # idle past the header timeout: still open
        writer.write(b"GET /health HTTP/1.1\r\nhost: proxy\r\n\r\n")
        assert (await reader.readuntil(b'{"status": "ok"}')).startswith(b"HTTP/1.1 200")
        writer.write(b"GET /health HTTP/1.1\r\n")  # the next request stalls mid-headers
        data, took = await read_until_eof(reader, 5)
        assert data == b"" and took < 2.0
        writer.close()
        # A connection that stays idle goes after the keep-alive timeout.
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(px))
        writer.write(b"GET /health HTTP/1.1\r\nhost: proxy\r\n\r\n")
        await reader.readuntil(b'{"status": "ok"}')
        data, took = await read_until_eof(reader, 8)
        assert data == b"" and 1.5 < took < 5.0
        writer.close()


async def test_partial_body_gets_408_and_the_connection_closed():
    limits = ClientLimits(header_timeout_s=5, body_timeout_s=0.5)
    with stack(limits=limits) as (px, p, (d,)):
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(px))
        full = post_raw(json.dumps(BODY).encode())
        writer.write(full[:-10])  # headers and most of the body, never the rest
        data, took = await read_until_eof(reader, 5)
        writer.close()
        status, headers, body = split_response(data)
        assert status == 408 and headers["connection"] == "close" and 0.4 < took < 2.0
        assert json.loads(body)["error"]["code"] == "body_timeout"
        assert metric(px.url, "pd_proxy_limit_hits_total", limit="body_timeout") == 1
    assert p.received == d.received == []


async def test_connection_cap_answers_503_and_frees_with_closed_connections():
    limits = ClientLimits(max_connections=3, header_timeout_s=10)
    with stack(limits=limits) as (px, _, _):
        held = [await asyncio.open_connection("127.0.0.1", port_of(px)) for _ in range(3)]
        await asyncio.sleep(0.2)
        assert px.call(lambda: px.proxy.guard.active) == 3
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(px))
        data, took = await read_until_eof(reader, 5)
        writer.close()
        status, headers, body = split_response(data)
        assert status == 503 and headers["connection"] == "close" and took < 2.0
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        held[0][1].close()
        await asyncio.sleep(0.2)
        r = httpx.get(px.url + "/health", timeout=5)  # a slot is free again
        assert r.status_code == 200
        assert metric(px.url, "pd_proxy_limit_hits_total", limit="connections") >= 1
        for _, w in held[1:]:
            w.close()


async def test_graceful_shutdown_is_not_delayed_by_slow_clients():
    limits = ClientLimits(header_timeout_s=30, body_timeout_s=30, keepalive_timeout_s=30)
    with stack(limits=limits, shutdown_grace_s=20) as (px, _, _):
        port = port_of(px)
        partial_headers = await asyncio.open_connection("127.0.0.1", port)
        partial_headers[1].write(b"POST /v1/completions HTTP/1.1\r\n")
        partial_body = await asyncio.open_connection("127.0.0.1", port)
        partial_body[1].write(post_raw(json.dumps(BODY).encode())[:-5])
        idle = await asyncio.open_connection("127.0.0.1", port)
        idle[1].write(b"GET /health HTTP/1.1\r\nhost: proxy\r\n\r\n")
        await idle[0].readuntil(b'{"status": "ok"}')
        await asyncio.sleep(0.3)  # the body request is in its handler, reading
        t0 = time.monotonic()
        px.stop(20)
        assert time.monotonic() - t0 < 1.5
        for reader, writer in (partial_headers, partial_body, idle):
            data, _ = await read_until_eof(reader, 3)
            assert data == b"" or data.startswith(b"HTTP/1.1 408")
            writer.close()


# -- 10: KV release on every TP rank --------------------------------------------------------


@contextmanager
def fake_side_channels(ranks: int) -> Iterator[tuple[int, list[tuple[int, str, str]]]]:
    """FAKE prefiller side channels: one ZMQ ROUTER per TP rank on consecutive loopback
    ports (base + rank), answering every release ok and recording (rank, id, secret)."""
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []
    for _ in range(20):  # bounded search for consecutive free ports
        base = free_port()
        try:
            for r in range(ranks):
                s = ctx.socket(zmq.ROUTER)
                s.setsockopt(zmq.LINGER, 0)
                socks.append(s)
                s.bind(f"tcp://127.0.0.1:{base + r}")
            break
        except zmq.ZMQError:
            for s in socks:
                s.close()
            socks = []
    assert socks, "no consecutive free ports"
    got: list[tuple[int, str, str]] = []
    stop = threading.Event()

    def run() -> None:
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        while not stop.is_set():
            for s, _ in poller.poll(50):
                ident, data = s.recv_multipart()
                msg = decode_pull(data)
                for item in msg.items:
                    got.append((socks.index(s), item.transfer_id, item.secret))
                    reply = PullReply(msg_id=msg.msg_id, transfer_id=item.transfer_id, ok=True)
                    s.send_multipart([ident, encode(reply)])

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield base, got
    finally:
        stop.set()
        t.join(5)
        for s in socks:
            s.close()
        ctx.term()


def test_hang_up_between_legs_releases_the_kv_on_every_tp_rank(caplog):
    caplog.set_level(logging.DEBUG, "proxy")
    secret = "tp-secret-" + "q" * 20
    with fake_side_channels(2) as (base, got), stack() as (px, p, (d,)):
        p.behavior.update(kv_port=base, kv_extra={"remote_tp_size": 2, "transfer_secret": secret})
        d.behavior["sleep"] = 5
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(px.url + "/v1/completions", json=BODY, timeout=0.5)
        assert wait_for(lambda: len(got) == 2)
        assert sorted(got) == [(0, "P-t", secret), (1, "P-t", secret)]
        assert wait_for(lambda: metric(px.url, "pd_proxy_kv_releases_total", result="ok") == 1)
    assert secret not in log_text(caplog)


# -- 11/12: log forging and secrets ---------------------------------------------------------


def test_request_id_rules_and_escaping():
    assert request_id("req-1.a:b_c") == ("req-1.a:b_c", True)
    for bad in ("a\nINFO forged", "a\x1b[31mred", "x" * 129, "a b", "é", "a\u2028b", ""):
        rid, ok = request_id(bad)
        assert not ok and len(rid) == 32 and rid.isalnum()
    assert escape("a\nb\x1b[31m\u2028") == "a\\x0ab\\x1b[31m\\u2028"
    assert escape("x" * 5000, 10).startswith("x" * 10 + "...")


def test_log_records_of_proxy_loggers_are_one_line(caplog):
    caplog.set_level(logging.INFO, "proxy")
    log = get_logger("proxy.request")
    log.info("request %s: %s", "id\nFORGED 2026 INFO proxy: admin key is x", "\x1b[31mred")
    try:
        raise ValueError("boom\nFORGED")
    except ValueError:
        log.exception("failed for %s", "a\rb")
    for r in caplog.records:
        msg = r.getMessage()
        assert "\n" not in msg and "\r" not in msg and "\x1b" not in msg and r.exc_info is None
    assert "FORGED" in caplog.records[1].getMessage()  # kept, as escaped text


async def test_unsafe_request_ids_are_replaced_and_logs_stay_clean(caplog):
    caplog.set_level(logging.DEBUG, "proxy")
    with stack() as (px, p, (d,)):
        body = json.dumps(BODY).encode()
        for rid in ("a\u2028INFO forged", "x" * 300, "evil\xff"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port_of(px))
            raw = post_raw(body).replace(
                b"content-length",
                b"x-request-id: " + rid.encode("utf-8", "surrogateescape") + b"\r\ncontent-length",
            )
            writer.write(raw)
            data = await reader.readuntil(b"}]")
            writer.close()
            status, headers, _ = split_response(data)
            assert status == 200
            new = headers["x-request-id"]
            assert len(new) == 32 and new.isalnum()  # a generated id replaced it
            assert p.received[-1]["headers"]["x-request-id"] == new
            assert d.received[-1]["headers"]["x-request-id"] == new
        # Control characters are refused by aiohttp's parser; its log line is escaped.
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(px))
        writer.write(post_raw(body, {"x-request-id": "a\x1b[31mINFO forged"}))
        data, _ = await read_until_eof(reader, 5)
        writer.close()
        assert data.startswith(b"HTTP/1.0 400") or data.startswith(b"HTTP/1.1 400")
    text = log_text(caplog)
    assert "\u2028" not in text and "\x1b" not in text and "\xff" not in text
    assert all("\n" not in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("status", [500, 400])
def test_client_text_echoed_by_a_decoder_forges_no_log_line_and_leaks_no_secret(caplog, status):
    caplog.set_level(logging.DEBUG, "proxy")
    secret = "echo-secret-" + "z" * 20
    with stack(decode_retries=0) as (px, p, (d,)):
        p.behavior["kv_extra"] = {"transfer_secret": secret}
        d.behavior["echo_error"] = status  # its error message quotes the request it got
        forged = "hi\n2026-01-01 INFO proxy.app: admin: removed all\x1b[2J"
        r = httpx.post(
            px.url + "/v1/completions",
            json={**BODY, "prompt": forged},
            headers={"x-request-id": "echo-1"},
        )
        assert r.status_code == (502 if status == 500 else 400)
        assert secret not in r.text and "<redacted>" in r.text  # the decoder got it, though
        assert d.received[0]["body"]["kv_transfer_params"]["transfer_secret"] == secret
        assert wait_for(lambda: metric(px.url, "pd_proxy_kv_releases_total") == 1)
    text = log_text(caplog)
    assert secret not in text and "\x1b" not in text
    assert all("\n" not in r.getMessage() for r in caplog.records)
    if status == 500:
        assert any("echo-1" in m and "decode leg" in m for m in caplog.messages)


def test_malformed_backend_answer_leaks_no_credentials(caplog):
    """aiohttp's response errors carry the request headers: their repr() put the
    Authorization sent to the backend into the client's error and the log."""
    caplog.set_level(logging.DEBUG, "proxy")
    d = FakeVllm("D")
    with fake_malformed_http() as bad, serve(d.app) as d_url:
        settings = ProxySettings(
            prefill=(bad,),
            decode=(d_url,),
            prefill_retries=0,
            health=NO_HEALTH,
            backend_auth="key",
            backend_key="backend-key-secret",
        )
        with serve_proxy(settings) as px:
            r = httpx.post(
                px.url + "/v1/completions",
                json=BODY,
                headers={"authorization": "Bearer client-key-secret"},
            )
            assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
            assert "ClientResponseError" in r.text
    for text in (r.text, log_text(caplog)):
        assert "backend-key-secret" not in text and "client-key-secret" not in text


# -- 13: admin weights and atomic adds ------------------------------------------------------

ADMIN = {"authorization": "Bearer adm"}


@pytest.mark.parametrize(
    "weight",
    [math.inf, "inf", "1e400", "nan", 1e9, 101, 0, -1, True, None, [1], "x" * 40],
    ids=repr,
)
def test_admin_refuses_bad_weights_quickly_and_changes_nothing(weight):
    with stack(admin_key="adm") as (px, _, _):
        before = httpx.get(px.url + "/admin/instances", headers=ADMIN).json()
        new = f"http://127.0.0.1:{free_port()}"
        t0 = time.monotonic()
        r = httpx.post(  # json.dumps writes inf as Infinity, which Python's parser reads
            px.url + "/admin/instances",
            content=json.dumps({"role": "decode", "url": new, "weight": weight}),
            headers=ADMIN,
        )
        assert r.status_code == 400 and time.monotonic() - t0 < 1.0
        assert "weight" in r.json()["error"]["message"]
        # As a query parameter too.
        r = httpx.post(
            px.url + "/admin/instances",
            params={"role": "prefill", "url": new, "weight": str(weight)},
            headers=ADMIN,
        )
        assert r.status_code == 400
        assert httpx.get(px.url + "/admin/instances", headers=ADMIN).json() == before
        assert httpx.post(px.url + "/v1/completions", json=BODY).status_code == 200


def test_admin_add_is_all_or_nothing():
    with stack(admin_key="adm") as (px, _, _):
        before = httpx.get(px.url + "/admin/instances", headers=ADMIN).json()
        d_url = px.proxy.decode.urls[0]
        for bad in (
            {"role": "decode", "url": d_url},  # already there
            {"role": "decode", "url": "http://127.0.0.1:1/\nx"},
            {"role": "decode", "url": "ftp://127.0.0.1:1"},
            {"role": "decode", "url": 12},
            {"role": "decode", "url": "http://127.0.0.1:1", "side_channel": {"x": 1}},
            {"role": "nope", "url": "http://127.0.0.1:1"},
        ):
            r = httpx.post(px.url + "/admin/instances", json=bad, headers=ADMIN)
            assert r.status_code == 400, bad
        deep = b'{"role": "decode", "url": ' + b"[" * 50_000
        r = httpx.post(px.url + "/admin/instances", content=deep, headers=ADMIN)
        assert r.status_code in (400, 413)
        assert httpx.get(px.url + "/admin/instances", headers=ADMIN).json() == before
        ok = {"role": "decode", "url": f"http://127.0.0.1:{free_port()}", "weight": 100}
        r = httpx.post(px.url + "/admin/instances", json=ok, headers=ADMIN)
        assert r.status_code == 201 and r.json()["weight"] == 100


def test_pool_add_changes_nothing_when_it_fails(monkeypatch):
    import proxy.pool as pool_mod

    pool = Pool("decode", [InstanceSpec("http://127.0.0.1:1")], "prefix")
    ring = (list(pool._ring.points), list(pool._ring.owners))

    def broken(data: bytes) -> int:
        raise OverflowError("ring")

    monkeypatch.setattr(pool_mod, "_h64", broken)
    with pytest.raises(OverflowError):
        pool.add(InstanceSpec("http://127.0.0.1:2", 2.0))
    assert pool.urls == ["http://127.0.0.1:1"]
    assert (pool._ring.points, pool._ring.owners) == ring
    for w in (math.inf, math.nan, 0.0, 1e9, -1.0):
        with pytest.raises(ValueError):
            InstanceSpec("http://127.0.0.1:3", w)


# -- settings -------------------------------------------------------------------------------


def test_hardening_flags_and_config_keys(tmp_path):
    from proxy.settings import load_config, parse_args

    s = parse_args(
        [
            "--prefill=http://127.0.0.1:1",
            "--decode=http://127.0.0.1:2",
            "--pool-wait-timeout=1.5",
            "--max-body-bytes=1000",
            "--offload-parse-bytes=10",
            "--parse-workers=2",
            "--header-timeout=3",
            "--body-timeout=4",
            "--keepalive-timeout=5",
            "--client-write-timeout=6",
            "--max-client-connections=7",
        ]
    )
    assert s.timeouts.pool_wait_s == 1.5
    assert s.limits == ClientLimits(1000, 10, 2, 3.0, 4.0, 5.0, 6.0, 7)
    cfg = tmp_path / "p.yaml"
    cfg.write_text("limits:\n  max_body_bytes: 2048\n  header_timeout_s: 1\n")
    assert load_config(cfg)["limits"] == ClientLimits(max_body_bytes=2048, header_timeout_s=1)
    for bad in ({"max_connections": 0}, {"header_timeout_s": math.inf}, {"body_timeout_s": -1}):
        with pytest.raises(ValueError):
            ClientLimits(**bad)
    with pytest.raises(SystemExit):
        parse_args(["--prefill=http://127.0.0.1:1,weight=inf", "--decode=http://127.0.0.1:2"])
