"""Transfer statistics: recorded by the worker's threads, shipped to vLLM each step.

vLLM collects :class:`P2pConnectorStats` from every worker through
``get_kv_connector_stats``, aggregates them, logs ``reduce()`` periodically, and feeds
them to :class:`P2pPromMetrics`, which exposes them on the instance's ``/metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from connector.recorder import EVENTS, GAUGES, SAMPLES, empty_data


@dataclass
class P2pConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = empty_data()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data.setdefault(k, []).extend(v)
        return self

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in (*SAMPLES, *EVENTS, *GAUGES))

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        push_s = np.asarray(d.get("push_seconds", []), dtype=float)
        push_b = float(np.sum(d.get("push_bytes", [])))
        pull_s = np.asarray(d.get("pull_seconds", []), dtype=float)
        out: dict[str, int | float] = {
            "Pushes": int(push_s.size),
            "Pulls": int(pull_s.size),
            "Push MB": round(push_b / 2**20, 3),
            "Push blocks": int(np.sum(d.get("push_blocks", []))),
            "Push segments": int(np.sum(d.get("push_segments", []))),
            "Push failures": len(d.get("push_failures", [])),
            "Pull failures": len(d.get("pull_failures", [])),
            "Expired": len(d.get("expired", [])),
            "Refused pulls": len(d.get("refused", [])),
            "Digest mismatches": len(d.get("digest_mismatches", [])),
            "Bad kv_transfer_params": len(d.get("bad_params", [])),
        }
        for key, label in (("held_requests", "Held requests"), ("waiting_pulls", "Waiting pulls")):
            if d.get(key):
                out[label] = int(d[key][-1])
        if push_s.size:
            out["Avg push ms"] = round(float(push_s.mean()) * 1e3, 3)
            out["Push MB/s"] = round(push_b / 2**20 / max(float(push_s.sum()), 1e-9), 1)
        if pull_s.size:
            out["Avg pull ms"] = round(float(pull_s.mean()) * 1e3, 3)
        return out


class P2pPromMetrics(KVConnectorPromMetrics):
    """``vllm:pd_kv_*`` series on the instance's /metrics, one set per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, doc: str) -> dict[int, Any]:
            c = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            return create_metric_per_engine(c, per_engine_labelvalues)

        def histogram(name: str, doc: str, buckets: list[float]) -> dict[int, Any]:
            h = self._histogram_cls(
                name=name, documentation=doc, buckets=buckets, labelnames=labelnames
            )
            return create_metric_per_engine(h, per_engine_labelvalues)

        self._counters = {
            "push_bytes": counter("vllm:pd_kv_pushed_bytes", "KV bytes pushed to decoders"),
            "push_blocks": counter("vllm:pd_kv_pushed_blocks", "KV blocks pushed to decoders"),
            "push_segments": counter(
                "vllm:pd_kv_pushed_segments", "Segments written after merging contiguous blocks"
            ),
            "pull_bytes": counter("vllm:pd_kv_pulled_bytes", "KV bytes received from prefillers"),
        }
        self._events = {
            name: counter(f"vllm:pd_kv_{name}", doc)
            for name, doc in (
                ("push_failures", "Pushes that failed (the decoder recomputes or fails)"),
                ("pull_failures", "Pulls that failed on the decoder"),
                ("expired", "Held requests freed because no decoder asked in time"),
                ("refused", "Pulls refused (unknown, ended, wrong secret, bad layout)"),
                ("digest_mismatches", "Received KV whose keyed digest did not match (opt-in)"),
                ("bad_params", "Requests whose kv_transfer_params were malformed (ignored)"),
            )
        }

        def gauge(name: str, doc: str) -> dict[int, Any]:
            g = self._gauge_cls(
                name=name, documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent"
            )
            return create_metric_per_engine(g, per_engine_labelvalues)

        # Levels for leak checks (issue 11's soak): both must return to 0 when idle.
        self._gauges = {
            "held_requests": gauge(
                "vllm:pd_kv_held_requests",
                "Requests whose KV blocks this prefiller holds for a decoder (freed when sent,"
                " released, failed or expired)",
            ),
            "waiting_pulls": gauge(
                "vllm:pd_kv_waiting_pulls", "Requests this decoder is pulling KV for right now"
            ),
        }
        buckets = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]
        self._push_time = histogram(
            "vllm:pd_kv_push_seconds", "Time to push one request's KV", buckets
        )
        self._pull_time = histogram(
            "vllm:pd_kv_pull_seconds", "Time from pull sent to blocks written, per request", buckets
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        for key, metric in self._counters.items():
            total = float(np.sum(d.get(key, [])))
            if total:
                metric[engine_idx].inc(total)
        for key, metric in self._events.items():
            if d.get(key):
                metric[engine_idx].inc(len(d[key]))
        for key, metric in self._gauges.items():
            if d.get(key):  # aggregated steps: the latest value wins
                metric[engine_idx].set(d[key][-1])
        for v in d.get("push_seconds", []):
            self._push_time[engine_idx].observe(v)
        for v in d.get("pull_seconds", []):
            self._pull_time[engine_idx].observe(v)
