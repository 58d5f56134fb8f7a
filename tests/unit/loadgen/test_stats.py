"""Statistics on known inputs: percentiles, TPOT, goodput, throughput, time series."""

from __future__ import annotations

import math

import numpy as np
import pytest

from scripts.loadgen.records import CANCELLED, ERROR, OK, RequestRecord
from scripts.loadgen.stats import (
    Slo,
    describe,
    is_good,
    percentile,
    phase_duration,
    summarize,
    timeseries,
    token_times,
)


def rec(i: int, start: float, ttft: float, e2el: float, out: int, **kw: object) -> RequestRecord:
    itl = kw.pop("itl", None)
    if itl is None:
        itl = [(e2el - ttft) / (out - 1)] * (out - 1) if out > 1 else []
    return RequestRecord(
        index=i,
        start_s=start,
        status=OK,
        ttft_s=ttft,
        e2el_s=e2el,
        itl_s=list(itl),  # type: ignore[arg-type]
        prompt_tokens=10,
        output_tokens=out,
        **kw,  # type: ignore[arg-type]
    )


def test_percentile_is_numpy_linear_like_vllm() -> None:
    xs = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 90) == pytest.approx(7.6)  # 4 + 0.6 * (10 - 4)
    assert percentile(xs, 99) == pytest.approx(float(np.percentile(xs, 99)))
    assert math.isnan(percentile([], 50))


def test_describe_scales_to_ms() -> None:
    d = describe([0.1, 0.2, 0.3])
    assert d["n"] == 3
    assert d["mean"] == pytest.approx(200.0)
    assert d["p50"] == pytest.approx(200.0)
    assert d["min"] == pytest.approx(100.0) and d["max"] == pytest.approx(300.0)
    assert math.isnan(describe([])["p99"])


def test_tpot_is_vllm_per_request_definition() -> None:
    r = rec(0, 0.0, ttft=0.5, e2el=1.4, out=10)
    assert r.tpot_s == pytest.approx((1.4 - 0.5) / 9)
    assert rec(1, 0.0, 0.5, 0.5, out=1).tpot_s is None  # one token: no TPOT
    not_streamed = rec(2, 0.0, 0.5, 1.4, out=10)
    not_streamed.streamed = False
    assert not_streamed.tpot_s is None


def test_summary_counts_throughput_and_pooled_itl() -> None:
    records = [
        rec(0, 0.0, ttft=0.1, e2el=1.0, out=10),
        rec(1, 0.5, ttft=0.3, e2el=1.5, out=5),
        RequestRecord(index=2, start_s=0.2, status=ERROR, error_kind="http_500"),
        RequestRecord(index=3, start_s=0.3, status=ERROR, error_kind="http_500"),
        RequestRecord(index=4, start_s=0.4, status=CANCELLED, error_kind="cancelled_at_stop"),
    ]
    s = summarize(records)
    assert (s["completed"], s["failed"], s["cancelled"]) == (2, 2, 1)
    assert s["errors"] == {"http_500": 2}
    assert s["duration_s"] == pytest.approx(2.0)  # first send 0.0 to last end 0.5 + 1.5
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(7.5)
    assert s["total_token_throughput"] == pytest.approx((20 + 15) / 2.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(((0.9 / 9) + (1.2 / 4)) / 2 * 1000)
    # ITL pools every gap of every request: 9 gaps of 100 ms and 4 of 300 ms.
    assert s["itl_ms"]["n"] == 13
    assert s["itl_ms"]["p50"] == pytest.approx(100.0)
    assert s["goodput"]["good"] is None  # no SLO given


def test_goodput_share_and_rate() -> None:
    records = [
        rec(0, 0.0, ttft=0.1, e2el=1.0, out=10),  # tpot 100 ms
        rec(1, 0.0, ttft=0.4, e2el=1.0, out=7),  # ttft too slow
        rec(2, 0.0, ttft=0.1, e2el=2.0, out=5),  # tpot 475 ms: too slow
        rec(3, 0.0, ttft=0.2, e2el=0.2, out=1),  # one token: TPOT counts as 0 (vLLM)
        RequestRecord(index=4, status=ERROR, error_kind="connect_error"),
    ]
    slo = Slo(ttft_ms=300, tpot_ms=200)
    assert [is_good(r, slo) for r in records] == [True, False, False, True, False]
    s = summarize(records, duration_s=4.0, slo=slo)
    assert s["goodput"]["good"] == 2
    assert s["goodput"]["share"] == pytest.approx(2 / 5)  # failed requests count as not good
    assert s["goodput"]["request_goodput"] == pytest.approx(0.5)  # vLLM: good per second


def test_goodput_slo_boundary_is_inclusive_like_vllm() -> None:
    r = rec(0, 0.0, ttft=0.25, e2el=0.25, out=1)
    assert is_good(r, Slo(ttft_ms=250))
    assert not is_good(r, Slo(ttft_ms=249.9))
    assert is_good(r, Slo(e2el_ms=250)) and not is_good(r, Slo(e2el_ms=200))


def test_non_streamed_ttft_slo_uses_whole_response_time() -> None:
    r = RequestRecord(index=0, status=OK, streamed=False, e2el_s=0.8, output_tokens=8)
    assert not is_good(r, Slo(ttft_ms=500))
    assert is_good(r, Slo(ttft_ms=900, tpot_ms=1))  # TPOT is not observable: not checked


def test_phase_duration_ignores_cancelled() -> None:
    records = [
        rec(0, 1.0, 0.1, 2.0, 3),
        RequestRecord(index=1, start_s=1.5, status=CANCELLED),
    ]
    assert phase_duration(records) == pytest.approx(2.0)
    assert phase_duration([]) == 0.0


def test_token_times_and_timeseries() -> None:
    r = rec(0, 1.0, ttft=0.5, e2el=1.5, out=3, itl=[0.25, 0.75])
    assert token_times(r) == pytest.approx([1.5, 1.75, 2.5])
    ts = timeseries([r], bucket_s=1.0)
    assert ts["t_s"] == [0.0, 1.0, 2.0]
    assert ts["output_tokens_per_s"] == pytest.approx([0.0, 2.0, 1.0])
    assert ts["completed_per_s"] == pytest.approx([0.0, 0.0, 1.0])
    # In flight 1.0..2.5: a full second in bucket 1 and half of bucket 2.
    assert ts["in_flight"] == pytest.approx([0.0, 1.0, 0.5])
    assert ts["mean_ttft_ms_by_start"][1] == pytest.approx(500.0)


def test_timeseries_spreads_server_token_count_over_chunks() -> None:
    # Two chunks but the server says 6 tokens: the total must still be 6.
    r = rec(0, 0.0, ttft=0.1, e2el=0.9, out=6, itl=[0.8])
    ts = timeseries([r], bucket_s=0.5)
    assert sum(ts["output_tokens_per_s"]) * 0.5 == pytest.approx(6.0)
