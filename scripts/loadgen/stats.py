"""Pure statistics over request records, defined the way vLLM's benchmark client does.

- TTFT: request start to the first SSE chunk that carries ``choices``.
- ITL: gaps between consecutive chunks that carry ``choices`` (pooled over requests).
- E2EL: request start to the last chunk that carries ``choices`` (the usage-only chunk
  and ``[DONE]`` do not extend it).
- TPOT per request: (E2EL - TTFT) / (output_tokens - 1), only when output_tokens > 1.
- Percentiles: numpy's default (linear interpolation), as ``np.percentile`` in vLLM.
- Throughputs divide by the phase's wall time (first send to last completion).
- Goodput: vLLM's ``request_goodput`` (good completed requests per second, TPOT counted
  as 0 for one-token answers) and, as the issue asks, the share of requests that were good.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from scripts.loadgen.records import CANCELLED, OK, RequestRecord

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; None means not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def active(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def to_json(self) -> dict[str, float | None]:
        return asdict(self)


def percentile(values: Sequence[float], p: float) -> float:
    """numpy's linear percentile; NaN for no values (vLLM prints 0 there, which hides gaps)."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=float), p))


def describe(
    values: Sequence[float], scale: float = 1000.0, pcts: Sequence[float] = DEFAULT_PERCENTILES
) -> dict[str, float]:
    """Count, mean, std, min, max and percentiles, scaled (seconds -> ms by default)."""
    arr = np.asarray(values, dtype=float) * scale
    out: dict[str, float] = {"n": float(arr.size)}
    if arr.size == 0:
        for k in ("mean", "std", "min", "max"):
            out[k] = math.nan
        for p in pcts:
            out[pct_key(p)] = math.nan
        return out
    out["mean"] = float(arr.mean())
    out["std"] = float(arr.std())
    out["min"] = float(arr.min())
    out["max"] = float(arr.max())
    for p in pcts:
        out[pct_key(p)] = float(np.percentile(arr, p))
    return out


def pct_key(p: float) -> str:
    return f"p{p:g}"


def is_good(r: RequestRecord, slo: Slo) -> bool:
    """Whether a request met every active SLO (vLLM's rule: SLO >= measured value)."""
    if not r.ok:
        return False
    if slo.ttft_ms is not None:
        # A non-streamed answer shows its first token only when the whole body arrives.
        first = r.ttft_s if r.ttft_s is not None else r.e2el_s
        if first is None or first * 1000.0 > slo.ttft_ms:
            return False
    if slo.tpot_ms is not None and r.streamed:
        tpot = r.tpot_s or 0.0  # vLLM counts TPOT as 0 when there is at most one token
        if tpot * 1000.0 > slo.tpot_ms:
            return False
    return not (slo.e2el_ms is not None and (r.e2el_s is None or r.e2el_s * 1000.0 > slo.e2el_ms))


def error_counts(records: Iterable[RequestRecord]) -> dict[str, int]:
    c = Counter(r.error_kind or "unknown" for r in records if r.status not in (OK, CANCELLED))
    return dict(sorted(c.items()))


def phase_duration(records: Sequence[RequestRecord]) -> float:
    """First send to last completion among finished requests (vLLM's benchmark duration)."""
    ends = [r.end_s for r in records if r.end_s is not None and r.status != CANCELLED]
    if not ends:
        return 0.0
    return max(ends) - min(r.start_s for r in records)


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float | None = None,
    slo: Slo | None = None,
    pcts: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """The summary of one phase: counts, throughputs, latency distributions, goodput."""
    slo = slo or Slo()
    dur = phase_duration(records) if duration_s is None else duration_s
    ok = [r for r in records if r.ok]
    failed = [r for r in records if r.status not in (OK, CANCELLED)]
    cancelled = [r for r in records if r.status == CANCELLED]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [t for r in ok if (t := r.tpot_s) is not None]
    itls = [x for r in ok for x in r.itl_s]
    e2els = [r.e2el_s for r in ok if r.e2el_s is not None]
    total_in = sum(r.prompt_tokens or 0 for r in ok)
    total_out = sum(r.output_tokens or 0 for r in ok)
    good = sum(1 for r in ok if is_good(r, slo)) if slo.active() else None
    settled = len(ok) + len(failed)

    def rate(x: float) -> float:
        return x / dur if dur > 0 else math.nan

    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "cancelled": len(cancelled),
        "errors": error_counts(records),
        "duration_s": dur,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(total_out),
        "total_token_throughput": rate(total_in + total_out),
        "ttft_ms": describe(ttfts, pcts=pcts),
        "tpot_ms": describe(tpots, pcts=pcts),
        "itl_ms": describe(itls, pcts=pcts),
        "e2el_ms": describe(e2els, pcts=pcts),
        "goodput": {
            "slo": slo.to_json(),
            "good": good,
            "share": (good / settled if settled else math.nan) if good is not None else None,
            "request_goodput": rate(good) if good is not None else None,
        },
    }


def token_times(r: RequestRecord) -> list[float]:
    """When each streamed chunk arrived, relative to the phase start (vLLM's reconstruction)."""
    if not r.ok or r.e2el_s is None:
        return []
    if r.ttft_s is None:  # not streamed: everything arrives at the end
        return [r.start_s + r.e2el_s] * (r.output_tokens or 1)
    times = [r.start_s + r.ttft_s]
    for gap in r.itl_s:
        times.append(times[-1] + gap)
    return times


def auto_bucket(horizon_s: float) -> float:
    """1 s buckets (as vLLM) for long phases; finer ones so a short phase has ~30 points."""
    for b in (0.05, 0.1, 0.2, 0.5):
        if horizon_s / b <= 60:
            return b
    return 1.0


def timeseries(
    records: Sequence[RequestRecord], bucket_s: float | None = None
) -> dict[str, list[float]]:
    """Per-bucket output tokens/s, completions/s, mean concurrency and mean latencies.

    Output tokens per bucket use the server's token count spread over the request's chunks,
    so a server that sends several tokens per chunk still sums to the right total. The
    concurrency is time-weighted: the average number of requests in flight in the bucket.
    """
    ends = [r.end_s for r in records if r.end_s is not None]
    horizon = max([*ends, *(r.start_s for r in records), 0.0])
    b = bucket_s or auto_bucket(horizon)
    n = max(1, math.ceil(horizon / b + 1e-9))
    tokens = np.zeros(n)
    done = np.zeros(n)
    busy = np.zeros(n)
    ttft_sum = np.zeros(n)
    ttft_n = np.zeros(n)
    e2el_sum = np.zeros(n)

    def idx(t: float) -> int:
        return min(max(int(t / b), 0), n - 1)

    for r in records:
        lo, hi = r.start_s, r.end_s if r.end_s is not None else horizon
        for i in range(idx(lo), idx(hi) + 1):
            busy[i] += max(0.0, min(hi, (i + 1) * b) - max(lo, i * b))
        if not r.ok:
            continue
        times = token_times(r)
        per_chunk = (r.output_tokens or len(times)) / max(1, len(times))
        for t in times:
            tokens[idx(t)] += per_chunk
        done[idx(hi)] += 1
        if r.ttft_s is not None:
            ttft_sum[idx(lo)] += r.ttft_s
            ttft_n[idx(lo)] += 1
        e2el_sum[idx(hi)] += r.e2el_s or 0.0

    def mean(total: np.ndarray, count: np.ndarray) -> list[float]:
        return [float(t / c * 1000.0) if c else math.nan for t, c in zip(total, count, strict=True)]

    return {
        "bucket_s": [b],
        "t_s": [i * b for i in range(n)],
        "output_tokens_per_s": (tokens / b).tolist(),
        "completed_per_s": (done / b).tolist(),
        "in_flight": (busy / b).tolist(),
        "mean_ttft_ms_by_start": mean(ttft_sum, ttft_n),
        "mean_e2el_ms_by_end": mean(e2el_sum, done),
    }
