"""Pure reading of Prometheus text pages: instance levels and proxy signals for the soak."""

from __future__ import annotations

import re
import time
from typing import Any

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Sample = tuple[str, dict[str, str], float]

# Instance levels that must all be 0 once the lab is idle, and counters the monitor
# watches for signs of a fault.
LEVELS = {
    "kv_usage": "vllm:kv_cache_usage_perc",
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "held_requests": "vllm:pd_kv_held_requests",
    "waiting_pulls": "vllm:pd_kv_waiting_pulls",
}
COUNTERS = {
    "pulled_bytes": "vllm:pd_kv_pulled_bytes_total",
    "push_failures": "vllm:pd_kv_push_failures_total",
    "pull_failures": "vllm:pd_kv_pull_failures_total",
    "expired": "vllm:pd_kv_expired_total",
}
# Proxy counters whose growth is a sign that something failed.
PROXY_COUNTERS = (
    "pd_proxy_retries_total",
    "pd_proxy_upstream_errors_total",
    "pd_proxy_client_disconnects_total",
    "pd_proxy_ejections_total",
    "pd_proxy_panic_routing_total",
    "pd_proxy_fallbacks_total",
)


def parse(text: str) -> list[Sample]:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.append((m.group(1), labels, value))
    return out


def total(samples: list[Sample], name: str, **match: str) -> float | None:
    """Sum of ``name`` over series whose labels include ``match``; None if absent."""
    vals = [
        v
        for n, lab, v in samples
        if n == name and all(lab.get(k) == want for k, want in match.items())
    ]
    return sum(vals) if vals else None


def instance_levels(text: str) -> dict[str, float]:
    """Levels and counters of one vLLM instance; a gauge never set reads 0 (idle)."""
    s = parse(text)
    out: dict[str, float] = {}
    for key, name in (*LEVELS.items(), *COUNTERS.items()):
        v = total(s, name)
        out[key] = 0.0 if v is None else v
    return out


def proxy_state(text: str) -> dict[str, Any]:
    """Per instance (healthy, breaker state, draining) and the failure counters' totals."""
    s = parse(text)
    inst: dict[str, dict[str, float]] = {}
    for n, lab, v in s:
        if n in (
            "pd_proxy_instance_healthy",
            "pd_proxy_breaker_state",
            "pd_proxy_instance_draining",
        ):
            key = lab.get("instance", "?")
            inst.setdefault(key, {})[n.removeprefix("pd_proxy_")] = v
    counters: dict[str, float] = {}
    for n, lab, v in s:
        if n in PROXY_COUNTERS:
            tag = ",".join(f"{k}={lab[k]}" for k in sorted(lab))
            counters[f"{n}{{{tag}}}"] = v
    return {"instances": inst, "counters": counters}


def proxy_changes(prev: dict[str, Any] | None, cur: dict[str, Any]) -> list[str]:
    """What changed between two proxy scrapes, as short signal texts."""
    if prev is None:
        return []
    out = []
    for url, now in cur["instances"].items():
        before = prev["instances"].get(url, {})
        for k, v in now.items():
            if before.get(k) is not None and before[k] != v:
                out.append(f"{k} {url} {before[k]:g}->{v:g}")
    for k, v in cur["counters"].items():
        if v > prev["counters"].get(k, 0.0):
            out.append(f"{k} +{v - prev['counters'].get(k, 0.0):g}")
    return out


_LOG = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) (WARNING|ERROR) (\S+): (.*)$")


def log_signals(text: str, wall0: float) -> list[dict[str, Any]]:
    """The proxy's WARNING/ERROR lines as signals at their millisecond timestamps, in
    seconds since ``wall0`` (the load's start on the wall clock; logging uses local time).
    Finer than the 1 s metric scrapes: a dead instance is usually seen here first."""
    out = []
    for line in text.splitlines():
        m = _LOG.match(line)
        if not m:
            continue
        wall = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3
        out.append(
            {
                "type": "signal",
                "t": round(wall - wall0, 3),
                "kind": "proxy_log",
                "what": m.group(5)[:240],
            }
        )
    return out


_UP = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) INFO proxy\.app: \w+ instance (\S+) is up$"
)


def proxy_up_times(text: str, wall0: float) -> list[tuple[float, str]]:
    """(seconds since ``wall0``, instance URL) of each "instance ... is up" line: when the
    proxy's health checks took an instance back."""
    out = []
    for line in text.splitlines():
        m = _UP.match(line)
        if m:
            wall = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
            out.append((round(wall + int(m.group(2)) / 1e3 - wall0, 3), m.group(3)))
    return out
