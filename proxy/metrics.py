"""Prometheus collectors of one proxy, in its own registry (several apps can coexist)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pd_proxy_requests",
            "Client requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.missing_kv_params = Counter(
            "pd_proxy_prefill_without_kv_params",
            "Prefill answers without kv_transfer_params (the decoder computed the prompt)",
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            "pd_proxy_upstream_errors",
            "Failed legs by leg and kind",
            ["leg", "kind"],
            registry=self.registry,
        )
        self.prefill_seconds = Histogram(
            "pd_proxy_prefill_seconds",
            "Prefill leg latency",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.decode_first_byte_seconds = Histogram(
            "pd_proxy_decode_first_byte_seconds",
            "Decode leg: time to response headers",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
