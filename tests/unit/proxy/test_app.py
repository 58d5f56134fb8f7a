"""The proxy over real HTTP against FAKE vLLM backends (tests/fake_vllm.py)."""

from __future__ import annotations

import json
from contextlib import contextmanager

import httpx
import pytest

from proxy.settings import ProxySettings, Timeouts
from tests.fake_vllm import FakeVllm
from tests.servers import free_port, serve
from tests.unit.proxy.helpers import serve_proxy


@pytest.fixture
def backends():
    p, d = FakeVllm("P"), FakeVllm("D")
    with serve(p.app) as p_url, serve(d.app) as d_url:
        yield p, d, p_url, d_url


@contextmanager
def proxy_for(p_url: str, d_url: str, **timeouts: float):
    settings = ProxySettings(
        prefill=(p_url,),
        decode=(d_url,),
        timeouts=Timeouts(**{"connect_s": 2.0, **timeouts}),
        release_timeout_s=0.5,
    )
    with serve_proxy(settings) as running:
        yield running.url


def prom_value(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_two_legs_and_request_id(backends):
    p, d, p_url, d_url = backends
    with proxy_for(p_url, d_url) as url:
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "m", "prompt": "hi", "max_tokens": 5},
            headers={"x-request-id": "rid-42", "authorization": "Bearer k"},
        )
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == "D:5"
    assert r.headers["x-request-id"] == "rid-42"
    (pre,), (dec,) = p.received, d.received
    assert pre["body"]["max_tokens"] == 1 and pre["body"]["kv_transfer_params"]["do_remote_decode"]
    assert dec["body"]["kv_transfer_params"]["transfer_id"] == "P-t"
    assert dec["body"]["max_tokens"] == 5
    for leg in (pre, dec):
        assert leg["headers"]["x-request-id"] == "rid-42"
        assert leg["headers"]["authorization"] == "Bearer k"


def test_generated_request_id_is_shared(backends):
    p, d, p_url, d_url = backends
    with proxy_for(p_url, d_url) as url:
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
        )
    rid = r.headers["x-request-id"]
    assert len(rid) >= 16
    assert (
        p.received[0]["headers"]["x-request-id"] == rid == d.received[0]["headers"]["x-request-id"]
    )
    assert p.received[0]["path"] == d.received[0]["path"] == "/v1/chat/completions"


def test_streaming_passes_sse_through(backends):
    p, _d, p_url, d_url = backends
    with (
        proxy_for(p_url, d_url) as url,
        httpx.stream(
            "POST",
            url + "/v1/completions",
            json={"model": "m", "prompt": "x", "stream": True, "max_tokens": 3},
        ) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = [e for e in body.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]] == [
        "D:3#0",
        "D:3#1",
        "D:3#2",
    ]
    assert p.received[0]["body"]["stream"] is False


def test_missing_kv_params_still_completes_and_is_counted(backends):
    p, d, p_url, d_url = backends
    p.behavior["no_kv_params"] = True
    with proxy_for(p_url, d_url) as url:
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x"})
        metrics = httpx.get(url + "/metrics").text
    assert r.status_code == 200
    assert "kv_transfer_params" not in d.received[0]["body"]
    assert prom_value(metrics, "pd_proxy_prefill_without_kv_params_total") == 1


@pytest.mark.parametrize("leg", ["P", "D"])
def test_client_error_keeps_status_and_body(backends, leg):
    p, d, p_url, d_url = backends
    (p if leg == "P" else d).behavior["status"] = 400
    with proxy_for(p_url, d_url) as url:
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == f"{leg} says no"


def test_backend_500_becomes_502(backends):
    _p, d, p_url, d_url = backends
    d.behavior["status"] = 500
    with proxy_for(p_url, d_url) as url:
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
    assert r.status_code == 502
    assert r.json()["error"]["message"] == "D says no"


def test_unreachable_prefill_is_502_quickly(backends):
    _, d, _, d_url = backends
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with proxy_for(closed, d_url) as url:
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
    assert r.status_code == 502
    body = r.json()["error"]
    assert body["code"] == "upstream_unreachable" and "prefill" in body["message"]
    assert d.received == []


def test_slow_prefill_times_out_with_504(backends):
    p, _, p_url, d_url = backends
    p.behavior["sleep"] = 5
    with proxy_for(p_url, d_url, prefill_s=0.5) as url:
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "upstream_timeout"


def test_stream_that_goes_silent_ends_with_error_event(backends):
    _, d, p_url, d_url = backends
    d.behavior["hang_after"] = 1
    with (
        proxy_for(p_url, d_url, idle_s=0.5) as url,
        httpx.stream(
            "POST",
            url + "/v1/completions",
            json={"model": "m", "prompt": "x", "stream": True},
            timeout=10,
        ) as r,
    ):
        body = r.read().decode()
    events = [e for e in body.split("\n\n") if e]
    assert json.loads(events[0][6:])["choices"][0]["text"].endswith("#0")
    assert json.loads(events[1][6:])["error"]["code"] == 504
    assert events[-1] == "data: [DONE]"


@pytest.mark.parametrize(
    ("content", "status", "needle"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"model": "m"}', 400, "'prompt' is required"),
        (b"[1, 2]", 400, "JSON object"),
    ],
)
def test_bad_input_gets_openai_error(backends, content, status, needle):
    p, _, p_url, d_url = backends
    with proxy_for(p_url, d_url) as url:
        r = httpx.post(
            url + "/v1/completions", content=content, headers={"content-type": "application/json"}
        )
    assert r.status_code == status
    assert needle in r.json()["error"]["message"]
    assert p.received == []


def test_unknown_route_is_openai_404(backends):
    _, _, p_url, d_url = backends
    with proxy_for(p_url, d_url) as url:
        r = httpx.get(url + "/v1/nothing")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"


def test_models_and_health(backends):
    _, _, p_url, d_url = backends
    with proxy_for(p_url, d_url) as url:
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "fake-model"


def test_round_robin_over_instances():
    ps = [FakeVllm(f"P{i}") for i in range(2)]
    ds = [FakeVllm(f"D{i}") for i in range(2)]
    with (
        serve(ps[0].app) as p0,
        serve(ps[1].app) as p1,
        serve(ds[0].app) as d0,
        serve(ds[1].app) as d1,
    ):
        settings = ProxySettings(
            prefill=(p0, p1),
            decode=(d0, d1),
            prefill_policy="round_robin",
            decode_policy="round_robin",
        )
        with serve_proxy(settings) as running:
            for _ in range(4):
                httpx.post(running.url + "/v1/completions", json={"model": "m", "prompt": "x"})
    assert [len(f.received) for f in (*ps, *ds)] == [2, 2, 2, 2]


async def test_wait_for_backends_returns_only_when_ready(backends):
    from proxy.readiness import wait_for_backends

    _, _, p_url, d_url = backends
    assert await wait_for_backends([p_url, d_url], timeout_s=5, poll_s=0.1) == []
    closed = f"http://127.0.0.1:{free_port()}"
    assert await wait_for_backends([p_url, closed], timeout_s=0.5, poll_s=0.1) == [closed]


def test_proxy_exits_when_backends_never_come(tmp_path):
    import subprocess
    import sys

    closed = f"http://127.0.0.1:{free_port()}"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "proxy",
            "--prefill",
            closed,
            "--decode",
            closed,
            "--port",
            str(free_port()),
            "--wait-backends",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 1
    assert "not ready after 1s" in r.stderr
