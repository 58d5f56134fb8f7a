"""The proxy over real HTTP against FAKE vLLM backends: retries, fallback, cancellation,
auth, admin API, health, breaker, metrics, graceful shutdown."""

from __future__ import annotations

import json
import logging
import time
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from proxy.settings import BreakerSettings, HealthSettings, ProxySettings, Timeouts
from tests.fake_vllm import FakeVllm, fake_dead_socket
from tests.servers import free_port, serve
from tests.unit.proxy.helpers import serve_proxy

BODY = {"model": "m", "prompt": "hello there", "max_tokens": 4}
NO_HEALTH = HealthSettings(interval_s=0)


@contextmanager
def stack(n_p: int = 1, n_d: int = 1, **kw):
    """n_p fake prefillers, n_d fake decoders and a proxy (round robin unless told)."""
    ps = [FakeVllm(f"P{i}") for i in range(n_p)]
    ds = [FakeVllm(f"D{i}") for i in range(n_d)]
    with ExitStack() as es:
        p_urls = [es.enter_context(serve(f.app)) for f in ps]
        d_urls = [es.enter_context(serve(f.app)) for f in ds]
        settings = ProxySettings(
            prefill=tuple(kw.pop("prefill", p_urls)),
            decode=tuple(kw.pop("decode", d_urls)),
            prefill_policy=kw.pop("prefill_policy", "round_robin"),
            decode_policy=kw.pop("decode_policy", "round_robin"),
            timeouts=kw.pop("timeouts", Timeouts(connect_s=2.0)),
            health=kw.pop("health", NO_HEALTH),
            release_timeout_s=0.5,
            **kw,
        )
        running = es.enter_context(serve_proxy(settings))
        yield running, ps, ds


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, value = line.rsplit(" ", 1)
        rest = head[len(name) :]
        if rest and rest[0] not in "{ ":
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


# -- retries ------------------------------------------------------------------------------


def test_failed_prefill_is_retried_on_another_prefiller(caplog):
    with stack(2, 1) as (px, (p0, p1), (d,)):
        p0.behavior["status"] = 500
        caplog.set_level(logging.INFO, "proxy")
        r = httpx.post(px.url + "/v1/completions", json=BODY, headers={"x-request-id": "rr1"})
        assert r.status_code == 200
        assert len(p0.received) == 1 and len(p1.received) == 1
        assert d.received[0]["body"]["kv_transfer_params"]["transfer_id"] == "P1-t"
        assert metric(px.url, "pd_proxy_retries_total", leg="prefill") == 1
    assert any("rr1" in m and "retrying" in m for m in caplog.messages)
    line = next(json.loads(m.split(" ", 1)[1]) for m in caplog.messages if '"rr1"' in m)
    assert line["retries"] == ["prefill:500"] and line["outcome"] == "ok"


def test_dead_socket_prefiller_is_retried():
    with fake_dead_socket() as dead:
        p = FakeVllm("P")
        d = FakeVllm("D")
        with serve(p.app) as p_url, serve(d.app) as d_url:
            s = ProxySettings(
                prefill=(dead, p_url),
                decode=(d_url,),
                prefill_policy="round_robin",
                health=NO_HEALTH,
            )
            with serve_proxy(s) as px:
                r = httpx.post(px.url + "/v1/completions", json=BODY)
                assert r.status_code == 200 and len(p.received) == 1
                assert metric(px.url, "pd_proxy_retries_total", leg="prefill", reason="broken") == 1


def test_decoder_failing_before_first_byte_is_retried_with_same_kv():
    with stack(1, 2) as (px, (p,), (d0, d1)):
        d0.behavior["status"] = 500
        r = httpx.post(px.url + "/v1/completions", json={**BODY, "stream": True})
        assert r.status_code == 200 and "D1:4#0" in r.text
        kv0 = d0.received[0]["body"]["kv_transfer_params"]
        assert kv0 == d1.received[0]["body"]["kv_transfer_params"] and kv0["transfer_id"] == "P0-t"
        assert len(p.received) == 1
        assert metric(px.url, "pd_proxy_retries_total", leg="decode") == 1


def test_unreachable_decoder_is_retried():
    closed = f"http://127.0.0.1:{free_port()}"
    d = FakeVllm("D")
    p = FakeVllm("P")
    with serve(p.app) as p_url, serve(d.app) as d_url:
        s = ProxySettings(
            prefill=(p_url,),
            decode=(closed, d_url),
            decode_policy="round_robin",
            health=NO_HEALTH,
        )
        with serve_proxy(s) as px:
            r = httpx.post(px.url + "/v1/completions", json=BODY)
            assert r.status_code == 200 and len(d.received) == 1
            assert metric(px.url, "pd_proxy_retries_total", leg="decode", reason="unreachable") == 1


def test_no_retry_after_bytes_reached_the_client():
    t = Timeouts(connect_s=2.0, idle_s=0.4)
    with stack(1, 2, timeouts=t) as (px, _, (d0, d1)):
        d0.behavior["hang_after"] = 1
        r = httpx.post(px.url + "/v1/completions", json={**BODY, "stream": True}, timeout=10)
        events = [e for e in r.text.split("\n\n") if e]
        assert "D0:4#0" in events[0] and json.loads(events[1][6:])["error"]["code"] == 504
        assert d1.received == []
        assert metric(px.url, "pd_proxy_retries_total") == 0


def test_missing_kv_params_on_prefill_is_not_an_error():
    with stack(1, 1) as (px, (p,), (d,)):
        p.behavior["no_kv_params"] = True
        r = httpx.post(px.url + "/v1/completions", json=BODY)
        assert r.status_code == 200 and "kv_transfer_params" not in d.received[0]["body"]


# -- fallback -----------------------------------------------------------------------------


def test_short_prompt_goes_to_the_decoder_alone():
    with stack(1, 1, min_prefill_tokens=50) as (px, (p,), (d,)):
        assert httpx.post(px.url + "/v1/completions", json=BODY).status_code == 200
        long = {**BODY, "prompt": "x" * 400}
        assert httpx.post(px.url + "/v1/completions", json=long).status_code == 200
        assert len(p.received) == 1 and len(d.received) == 2
        assert "kv_transfer_params" not in d.received[0]["body"]
        assert metric(px.url, "pd_proxy_fallbacks_total", reason="short_prompt") == 1


def test_no_healthy_prefiller_falls_back_and_ready_says_so():
    h = HealthSettings(interval_s=0.05, timeout_s=1, fall=2, rise=1)
    with stack(1, 1, health=h) as (px, (p,), (_d,)):
        assert wait_for(lambda: httpx.get(px.url + "/ready").status_code == 200)
        p.health_status = 503
        assert wait_for(lambda: httpx.get(px.url + "/ready").status_code == 503)
        assert httpx.get(px.url + "/health").status_code == 200  # live all the same
        r = httpx.post(px.url + "/v1/completions", json=BODY)
        assert r.status_code == 200 and p.received == []
        assert metric(px.url, "pd_proxy_fallbacks_total", reason="no_prefiller") == 1
        assert metric(px.url, "pd_proxy_instance_healthy", role="prefill") == 0
        p.health_status = 200
        assert wait_for(lambda: httpx.get(px.url + "/ready").status_code == 200)
        httpx.post(px.url + "/v1/completions", json=BODY)
        assert len(p.received) == 1


def test_one_failed_check_is_below_the_threshold():
    with stack(1, 1, health=HealthSettings(interval_s=0)) as (px, (_p,), _):
        inst = px.proxy.prefill.instances[0]
        px.call(px.proxy.apply_check, inst, "boom")
        assert inst.healthy
        px.call(px.proxy.apply_check, inst, "boom")
        assert not inst.healthy
        px.call(px.proxy.apply_check, inst, None)
        assert inst.healthy


def test_circuit_breaker_opens_after_consecutive_failures():
    br = BreakerSettings(gateway_failures=2, answer_failures=2, open_s=60)
    with stack(2, 1, breaker=br, prefill_retries=0) as (px, (p0, _p1), _):
        p0.behavior["status"] = 500
        for _ in range(6):
            httpx.post(px.url + "/v1/completions", json=BODY)
        assert len(p0.received) == 2  # then the breaker kept it out
        assert metric(px.url, "pd_proxy_breaker_state", instance=px.proxy.prefill.urls[0]) == 2
        assert metric(px.url, "pd_proxy_ejections_total", role="prefill", reason="answer") == 1


def test_poison_answers_never_leave_a_single_decoder_ejected():
    """The issue's outage: one decoder, a few 5xx answers caused by requests, then every
    normal request refused for open_s. Now the last serving decoder stays in."""
    br = BreakerSettings(gateway_failures=1, answer_failures=1, open_s=60)
    with stack(1, 1, breaker=br, decode_retries=0) as (px, _, (d,)):
        d.behavior["status"] = 500
        for _ in range(4):
            assert httpx.post(px.url + "/v1/completions", json=BODY).status_code == 502
        d.behavior.clear()
        r = httpx.post(px.url + "/v1/completions", json=BODY)
        assert r.status_code == 200, r.text
        assert px.proxy.decode.instances[0].breaker.state == "closed"
        refused = metric(px.url, "pd_proxy_ejections_refused_total", role="decode")
        assert refused == 4 and metric(px.url, "pd_proxy_ejections_total") == 0


def test_no_decoder_is_a_503_before_any_prefill():
    """Nothing to decode on: the prefiller is not asked, so no blocks are held for nobody."""
    with stack(1, 1) as (px, (p,), _):
        px.call(px.proxy.decode.remove, px.proxy.decode.urls[0])
        r = httpx.post(px.url + "/v1/completions", json=BODY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_instance"
        assert p.received == []


def test_a_half_open_trial_whose_client_hung_up_goes_back():
    """Before: the trial stayed "out" forever, so the instance never got traffic again."""
    br = BreakerSettings(gateway_failures=1, open_s=0.3)
    with stack(1, 2, breaker=br, decode_retries=0) as (px, _, (d0, _d1)):
        i0, i1 = px.proxy.decode.instances
        px.call(px.proxy.decode.failure, i0, "gateway")
        assert i0.breaker.state == "open"
        i1.healthy = False  # so the next request is d0's half-open trial
        time.sleep(0.35)
        d0.behavior["sleep"] = 10
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(px.url + "/v1/completions", json=BODY, timeout=0.5)
        assert wait_for(lambda: len(d0.cancelled) == 1, 5)
        assert wait_for(lambda: px.call(i0.breaker.allows), 5)
        d0.behavior.clear()
        assert httpx.post(px.url + "/v1/completions", json=BODY).status_code == 200
        assert i0.breaker.state == "closed"


# -- protocol fidelity --------------------------------------------------------------------


def test_n_greater_than_one_is_served_by_the_decoder_alone():
    with stack() as (px, (p,), (d,)):
        r = httpx.post(px.url + "/v1/completions", json={**BODY, "n": 2})
        assert r.status_code == 200 and p.received == [] and d.received[0]["body"]["n"] == 2
        assert metric(px.url, "pd_proxy_fallbacks_total", reason="n") == 1


def test_best_of_is_a_clear_400():
    with stack() as (px, (p,), (d,)):
        r = httpx.post(px.url + "/v1/completions", json={**BODY, "best_of": 2})
        assert r.status_code == 400 and "best_of" in r.json()["error"]["message"]
        assert p.received == d.received == []


def test_echo_and_logprobs_reach_the_decoder_only():
    with stack() as (px, (p,), (d,)):
        r = httpx.post(px.url + "/v1/completions", json={**BODY, "echo": True, "logprobs": None})
        assert r.status_code == 200
        assert "echo" not in p.received[0]["body"] and d.received[0]["body"]["echo"] is True
        chat = {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "logprobs": True,
            "top_logprobs": 2,
        }
        assert httpx.post(px.url + "/v1/chat/completions", json=chat).status_code == 200
        assert "logprobs" not in p.received[1]["body"]
        assert d.received[1]["body"]["top_logprobs"] == 2
        r = httpx.post(px.url + "/v1/completions", json={**BODY, "echo": True, "logprobs": 1})
        assert r.status_code == 200 and len(p.received) == 2  # prompt logprobs: decoder alone


# -- client disconnect --------------------------------------------------------------------


def test_client_hanging_up_mid_stream_cancels_the_decoder():
    with stack() as (px, _, (d,)):
        d.behavior.update(chunks=50, chunk_delay=0.1)
        with httpx.stream(
            "POST",
            px.url + "/v1/completions",
            json={**BODY, "stream": True},
            headers={"x-request-id": "gone-1"},
            timeout=10,
        ) as r:
            next(r.iter_raw())
        assert wait_for(lambda: d.cancelled == ["gone-1"], 3)
        assert wait_for(
            lambda: metric(px.url, "pd_proxy_client_disconnects_total", phase="decode_stream") == 1
        )
        assert metric(px.url, "pd_proxy_instance_inflight", role="decode") == 0


def test_client_hanging_up_during_prefill_cancels_it():
    with stack() as (px, (p,), (d,)):
        p.behavior["sleep"] = 5
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                px.url + "/v1/completions",
                json=BODY,
                headers={"x-request-id": "gone-2"},
                timeout=0.5,
            )
        assert wait_for(lambda: p.cancelled == ["gone-2"], 3)
        assert wait_for(
            lambda: metric(px.url, "pd_proxy_client_disconnects_total", phase="prefill") == 1
        )
        assert d.received == []
        assert metric(px.url, "pd_proxy_instance_inflight") == 0


def test_client_hanging_up_between_legs_releases_the_kv():
    with stack() as (px, (_p,), (d,)):
        d.behavior["sleep"] = 5
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(px.url + "/v1/completions", json=BODY, timeout=0.5)
        # The fake's side channel is a closed port: the release is tried and fails fast.
        assert wait_for(lambda: metric(px.url, "pd_proxy_kv_releases_total") == 1, 3)
        assert wait_for(lambda: len(d.cancelled) == 1, 3)


def test_decode_failing_everywhere_releases_the_kv():
    with stack(1, 1) as (px, _, (d,)):
        d.behavior["status"] = 503
        assert httpx.post(px.url + "/v1/completions", json=BODY).status_code == 502
        assert wait_for(lambda: metric(px.url, "pd_proxy_kv_releases_total") == 1, 3)


# -- auth ---------------------------------------------------------------------------------


def test_api_keys_and_backend_key():
    with stack(api_keys=("k1",), backend_auth="key", backend_key="bk") as (px, (p,), (d,)):
        assert httpx.post(px.url + "/v1/completions", json=BODY).status_code == 401
        bad = {"authorization": "Bearer k2"}
        assert httpx.post(px.url + "/v1/completions", json=BODY, headers=bad).status_code == 401
        ok = {"authorization": "Bearer k1"}
        assert httpx.post(px.url + "/v1/completions", json=BODY, headers=ok).status_code == 200
        for leg in (p.received[0], d.received[0]):
            assert leg["headers"]["authorization"] == "Bearer bk"
        assert httpx.get(px.url + "/health").status_code == 200


# -- admin --------------------------------------------------------------------------------


def test_admin_api_needs_its_key():
    with stack() as (px, _, _):
        assert httpx.get(px.url + "/admin/instances").status_code == 403
    with stack(admin_key="adm") as (px, _, _):
        assert httpx.get(px.url + "/admin/instances").status_code == 401
        h = {"authorization": "Bearer adm"}
        got = httpx.get(px.url + "/admin/instances", headers=h).json()["instances"]
        assert [i["role"] for i in got] == ["prefill", "decode"]


def test_admin_add_and_remove_drains_without_dropping():
    h = {"authorization": "Bearer adm"}
    extra = FakeVllm("D9")
    with serve(extra.app) as d9, stack(admin_key="adm") as (px, _, (d0,)):
        r = httpx.post(
            px.url + "/admin/instances", json={"role": "decode", "url": d9, "weight": 1}, headers=h
        )
        assert r.status_code == 201
        for _ in range(2):
            httpx.post(px.url + "/v1/completions", json=BODY)
        assert len(extra.received) == 1 and len(d0.received) == 1
        extra.behavior.update(chunks=10, chunk_delay=0.1)
        d0.behavior.update(chunks=10, chunk_delay=0.1)
        with httpx.stream(
            "POST", px.url + "/v1/completions", json={**BODY, "stream": True}, timeout=10
        ) as s:
            it = s.iter_raw()
            first = next(it)
            serving = extra if len(extra.received) == 2 else d0
            url = d9 if serving is extra else px.proxy.decode.urls[0]
            r = httpx.request(
                "DELETE",
                px.url + "/admin/instances",
                json={"role": "decode", "url": url},
                headers=h,
            )
            assert r.status_code == 202 and r.json()["draining"] and r.json()["inflight"] == 1
            rest = b"".join(it)
        text = (first + rest).decode()
        assert text.count("#") == 10 and text.endswith("data: [DONE]\n\n")
        assert serving.cancelled == []
        urls = [
            i["url"] for i in httpx.get(px.url + "/admin/instances", headers=h).json()["instances"]
        ]
        assert url not in urls


# -- metrics, logs, shutdown --------------------------------------------------------------


def test_metrics_series_exist_after_a_request():
    with stack() as (px, _, (d,)):
        d.behavior["chunk_delay"] = 0.02  # chunks arrive apart (ones already there merge)
        httpx.post(px.url + "/v1/completions", json={**BODY, "stream": True})
        text = httpx.get(px.url + "/metrics").text
    for name in (
        'pd_proxy_requests_total{endpoint="completions",outcome="ok"} 1.0',
        "pd_proxy_prefill_seconds_count 1.0",
        "pd_proxy_decode_first_byte_seconds_count 1.0",
        "pd_proxy_time_to_first_token_seconds_count 1.0",
        "pd_proxy_added_seconds_count 1.0",
        "pd_proxy_instance_inflight{",
        "pd_proxy_breaker_state{",
        "pd_proxy_instance_healthy{",
    ):
        assert name in text, name
    gaps = [ln for ln in text.splitlines() if ln.startswith("pd_proxy_inter_chunk_seconds_count")]
    assert float(gaps[0].split()[1]) >= 2


def test_graceful_shutdown_lets_streams_finish_and_refuses_new_ones():
    with stack() as (px, _, (d,)):
        d.behavior.update(chunks=8, chunk_delay=0.1)
        with httpx.stream(
            "POST", px.url + "/v1/completions", json={**BODY, "stream": True}, timeout=10
        ) as s:
            it = s.iter_raw()
            first = next(it)
            fut = px.loop.call_soon_threadsafe  # stop() runs on the proxy's loop
            import asyncio

            stopping = asyncio.run_coroutine_threadsafe(px.proxy.stop(5), px.loop)
            assert wait_for(lambda: px.proxy.shutting_down)
            time.sleep(0.1)
            with pytest.raises(httpx.ConnectError):
                httpx.post(px.url + "/v1/completions", json=BODY, timeout=2)
            rest = b"".join(it)
            stopping.result(10)
            del fut
        assert (first + rest).decode().endswith("data: [DONE]\n\n")
        assert d.cancelled == []


def test_graceful_shutdown_cancels_after_the_deadline():
    import asyncio

    with stack() as (px, _, (d,)):
        d.behavior.update(chunks=100, chunk_delay=0.1)
        with httpx.stream(
            "POST",
            px.url + "/v1/completions",
            json={**BODY, "stream": True},
            headers={"x-request-id": "cut"},
            timeout=10,
        ) as s:
            it = s.iter_raw()
            next(it)
            t0 = time.monotonic()
            asyncio.run_coroutine_threadsafe(px.proxy.stop(0.3), px.loop).result(10)
            assert time.monotonic() - t0 < 5
            with pytest.raises(httpx.HTTPError):
                b"".join(it)
        assert wait_for(lambda: d.cancelled == ["cut"], 3)


def test_decoders_marked_down_get_panic_routing_without_a_prefill():
    """Health marks lag (a decoder that just came back): no healthy decoder is not a 503.
    The request goes to the decoder alone, so a failed pick wastes no prefill."""
    with stack(1, 1) as (px, (p,), (d,)):
        inst = px.proxy.decode.instances[0]
        px.call(setattr, inst, "healthy", False)
        assert httpx.get(px.url + "/v1/models").status_code == 200
        assert httpx.post(px.url + "/v1/completions", json=BODY).status_code == 200
        assert len(d.received) == 1 and p.received == []
        assert "kv_transfer_params" not in d.received[0]["body"]
        assert metric(px.url, "pd_proxy_panic_routing_total", role="decode") == 2
        assert metric(px.url, "pd_proxy_fallbacks_total", reason="no_healthy_decoder") == 1
