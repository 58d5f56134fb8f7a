"""The soak's invariants on hand-made records: each check passes on a clean run and fails
on the one thing it guards."""

from scripts.chaos import invariants as I
from scripts.chaos.promtext import instance_levels, proxy_changes, proxy_state


def req(i, start, end, outcome="ok", **kw):
    return {
        "id": f"r{i}",
        "start": start,
        "end": end,
        "outcome": outcome,
        "expected": None,
        "match": True if outcome == "ok" else None,
        **kw,
    }


FAULT = {
    "index": 0,
    "kind": "kill_decode",
    "role": "decode",
    "name": "D1",
    "url": "http://d1",
    "start": 10.0,
    "end": 30.0,
    "back": 30.0,
    "settle_end": 35.0,
}
IDLE = {"kv_usage": 0.0, "running": 0.0, "waiting": 0.0, "held_requests": 0.0, "waiting_pulls": 0.0}


def verdicts(checks):
    return {c.name: c.passed for c in checks}


def test_clean_run_passes_everything_gating():
    reqs = [
        req(0, 1, 2),
        req(1, 12, 13, "error"),
        req(2, 31, 32, decode_url="http://d1"),
        req(3, 40, 41),
    ]
    signals = [{"t": 10.8, "kind": "proxy", "what": "healthy"}]
    rss = {"proxy pid 1": [(t, 100.0) for t in range(10)]}
    checks, timings = I.evaluate(reqs, [FAULT], {"P0": IDLE}, rss, signals)
    assert all(c.passed for c in checks if c.gating), [c for c in checks if not c.passed]
    (t,) = timings
    assert t.detect_s == 0.8 and t.recover_s == 1.0 and t.errors == 1


def test_hang_broken_and_wrong_answers_fail():
    reqs = [req(0, 1, 61, "hang"), req(1, 2, 3, "broken", error="reset"), req(2, 4, 5, match=False)]
    v = verdicts(I.evaluate(reqs, [], {"P0": IDLE}, {}, [])[0])
    assert not v["no hang (every request ends by its deadline)"]
    assert not v["complete answer or clean OpenAI error"]
    assert not v["greedy answers equal the colocated ones"]


def test_errors_outside_windows_fail_but_intended_ones_do_not():
    reqs = [
        req(0, 50, 51, "error"),
        req(1, 60, 61, "cancelled", expected="hangup_mid_stream"),
        req(2, 70, 71, "error", expected="poison_400"),
        req(3, 80, 81),
    ]
    window_check, rate = I.check_errors_in_windows(reqs, [FAULT])
    assert not window_check.passed and "r0(error)" in window_check.detail
    assert rate.detail.startswith("50.00% (1/2)") and not rate.gating
    window_check, _ = I.check_errors_in_windows(reqs[1:], [FAULT])
    assert window_check.passed


def test_request_overlapping_a_window_edge_counts_inside():
    assert I.in_any_window(req(0, 5, 10.5), [FAULT])
    assert I.in_any_window(req(0, 34.9, 40), [FAULT])
    assert not I.in_any_window(req(0, 35.1, 40), [FAULT])


def test_leaks_after_quiescence_fail():
    held = {**IDLE, "held_requests": 1.0}
    c = I.check_quiescent({"P0": held, "D0": IDLE})
    assert not c.passed and "P0 held_requests=1" in c.detail
    assert not I.check_quiescent({"D1": {}}).passed  # unreadable counts as failed
    assert I.check_quiescent({"P0": IDLE, "D0": IDLE}).passed


def test_rss_growth_rule():
    flat = [(t, 1000.0 + (t % 3)) for t in range(40)]
    grows = [(t, 1000.0 + 10 * t) for t in range(40)]
    assert I.check_rss({"D0 pid 1": flat}).passed
    c = I.check_rss({"D0 pid 1": flat, "proxy pid 2": grows})
    assert not c.passed and "proxy pid 2" in c.detail
    assert I.rss_growth([(0, 1.0)] * 3, 0.1, 0) is None  # too few samples: skipped
    assert not I.check_rss({}).passed  # nothing measured is not a pass


def test_recovery_needs_the_faulted_instance_to_serve_again():
    reqs = [req(0, 31, 32, decode_url="http://d0"), req(1, 33.5, 34, decode_url="http://d1")]
    (t,) = I.fault_timings([FAULT], reqs, [])
    assert t.recover_s == 3.5 and t.detect_s is None
    part = {**FAULT, "kind": "block_mooncake", "back": 30.0}
    (t,) = I.fault_timings([part], reqs, [{"t": 30.7, "kind": "kv_flow", "what": "D0"}])
    assert t.recover_s == 0.7
    goals = I.goal_checks(I.fault_timings([FAULT], reqs, [{"t": 12.5, "kind": "proxy"}]))
    assert [g.passed for g in goals] == [False, False] and not any(g.gating for g in goals)


METRICS = """# HELP vllm:kv_cache_usage_perc x
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:pd_kv_held_requests{engine="0",model_name="m"} 1.0
vllm:pd_kv_pulled_bytes_total{engine="0",model_name="m"} 4096.0
"""


def test_instance_levels_read_and_default_to_zero():
    lv = instance_levels(METRICS)
    assert lv["kv_usage"] == 0.25 and lv["running"] == 2 and lv["held_requests"] == 1
    assert lv["waiting_pulls"] == 0 and lv["pulled_bytes"] == 4096


PROXY_A = """pd_proxy_instance_healthy{role="decode",instance="http://d0"} 1.0
pd_proxy_breaker_state{role="decode",instance="http://d0"} 0.0
pd_proxy_retries_total{leg="prefill",reason="connect"} 1.0
"""
PROXY_B = """pd_proxy_instance_healthy{role="decode",instance="http://d0"} 0.0
pd_proxy_breaker_state{role="decode",instance="http://d0"} 0.0
pd_proxy_retries_total{leg="prefill",reason="connect"} 3.0
pd_proxy_client_disconnects_total{phase="prefill"} 1.0
"""


def test_proxy_changes_are_signals():
    a, b = proxy_state(PROXY_A), proxy_state(PROXY_B)
    assert proxy_changes(None, a) == []
    changes = proxy_changes(a, b)
    assert "instance_healthy http://d0 1->0" in changes
    assert any(
        c.startswith("pd_proxy_retries_total{leg=prefill,reason=connect} +2") for c in changes
    )
    assert any("client_disconnects" in c for c in changes)
    assert proxy_changes(b, b) == []


def test_proxy_log_warnings_become_millisecond_signals():
    import time

    from scripts.chaos.promtext import log_signals

    text = (
        "2026-11-23 16:38:19,670 WARNING proxy.app: prefill instance http://p0 ejected for 5s\n"
        '2026-11-23 16:38:19,700 INFO proxy.request: request {"request_id": "x"}\n'
        "2026-11-23 16:38:21,005 ERROR proxy.app: request y failed unexpectedly: boom\n"
    )
    wall0 = time.mktime(time.strptime("2026-11-23 16:38:19", "%Y-%m-%d %H:%M:%S"))
    sigs = log_signals(text, wall0)
    assert [s["t"] for s in sigs] == [0.67, 2.005]
    assert sigs[0]["what"].startswith("prefill instance http://p0 ejected")


def test_a_failure_belongs_to_the_window_it_ended_in():
    first = {**FAULT, "index": 0, "start": 10.0, "end": 20.0, "settle_end": 25.0}
    second = {**FAULT, "index": 1, "start": 26.0, "end": 30.0, "settle_end": 35.0}
    reqs = [req(0, 22.0, 31.0, "error")]  # started in the first window, failed in the second
    t1, t2 = I.fault_timings([first, second], reqs, [])
    assert (t1.errors, t2.errors) == (0, 1)
    assert t1.requests == t2.requests == 1


def test_proxy_taking_the_instance_back_is_the_recovery_goal():
    import time

    from scripts.chaos.promtext import proxy_up_times

    text = (
        "2026-11-23 16:38:19,500 INFO proxy.app: decode instance http://d1 is up\n"
        "2026-11-23 16:38:19,600 WARNING proxy.app: decode instance http://d1 is down: x\n"
    )
    wall0 = time.mktime(time.strptime("2026-11-23 16:38:00", "%Y-%m-%d %H:%M:%S"))
    ups = proxy_up_times(text, wall0)
    assert ups == [(19.5, "http://d1")]
    reqs = [req(0, 33.5, 34, decode_url="http://d1")]
    late_up = [(5.0, "http://d1"), (30.8, "http://d1"), (31.0, "http://d0")]
    (t,) = I.fault_timings([FAULT], reqs, [], late_up)
    assert t.proxy_up_s == 0.8 and t.recover_s == 3.5
    recovery, _ = I.goal_checks([t])
    assert recovery.passed and "first request served OK by it after max 3.50 s" in recovery.detail
