"""Prometheus collectors of one proxy, in its own registry (several proxies can coexist).

Per-instance state (in flight, health, breaker) is read from the pools at scrape time by
a custom collector, so the request path pays nothing for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from proxy.pool import CircuitBreaker, Instance

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_FAST_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    5,
)


class _InstanceCollector(Collector):
    def __init__(self, instances: Callable[[], Iterable[Instance]]) -> None:
        self._instances = instances

    def collect(self):
        labels = ["role", "instance"]
        inflight = GaugeMetricFamily(
            "pd_proxy_instance_inflight", "Legs in flight per instance", labels=labels
        )
        tokens = GaugeMetricFamily(
            "pd_proxy_instance_inflight_prompt_tokens",
            "Estimated prompt tokens in flight per instance",
            labels=labels,
        )
        healthy = GaugeMetricFamily(
            "pd_proxy_instance_healthy", "1 if the health checks pass", labels=labels
        )
        draining = GaugeMetricFamily(
            "pd_proxy_instance_draining", "1 while being removed", labels=labels
        )
        breaker = GaugeMetricFamily(
            "pd_proxy_breaker_state",
            "Circuit breaker per instance: 0 closed, 1 half-open, 2 open",
            labels=labels,
        )
        for i in self._instances():
            lv = [i.role, i.url]
            inflight.add_metric(lv, i.inflight)
            tokens.add_metric(lv, i.inflight_tokens)
            healthy.add_metric(lv, 1 if i.healthy else 0)
            draining.add_metric(lv, 1 if i.draining else 0)
            breaker.add_metric(lv, CircuitBreaker.STATE_CODE[i.breaker.state])
        yield from (inflight, tokens, healthy, draining, breaker)


class ProxyMetrics:
    def pool_event(self, event: str, role: str, reason: str, url: str = "") -> None:
        """A pool's ``on_event`` hook (see :class:`proxy.pool.Pool`)."""
        if event == "ejected":
            self.ejections.labels(role, reason).inc()
        elif event == "ejection_refused":
            self.ejections_refused.labels(role, reason).inc()
        elif event == "panic":
            self.panic_routing.labels(role).inc()

    def __init__(
        self,
        instances: Callable[[], Iterable[Instance]] | None = None,
        client_connections: Callable[[], float] | None = None,
    ) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "pd_proxy_requests",
            "Client requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.missing_kv_params = Counter(
            "pd_proxy_prefill_without_kv_params",
            "Prefill answers without kv_transfer_params (the decoder computed the prompt)",
            registry=r,
        )
        self.upstream_errors = Counter(
            "pd_proxy_upstream_errors", "Failed legs by leg and kind", ["leg", "kind"], registry=r
        )
        self.retries = Counter(
            "pd_proxy_retries",
            "Legs retried on another instance, by leg and the failure that caused it",
            ["leg", "reason"],
            registry=r,
        )
        self.fallbacks = Counter(
            "pd_proxy_fallbacks",
            "Requests served by a decoder alone (no prefill leg), by reason",
            ["reason"],
            registry=r,
        )
        self.ejections = Counter(
            "pd_proxy_ejections",
            "Instances ejected by their circuit breaker, by role and failure kind (gateway:"
            " no answer; answer: 5xx)",
            ["role", "reason"],
            registry=r,
        )
        self.ejections_refused = Counter(
            "pd_proxy_ejections_refused",
            "Failures that reached the ejection threshold but were kept in: the role would"
            " exceed max_ejection_percent or lose its last serving instance",
            ["role", "reason"],
            registry=r,
        )
        self.panic_routing = Counter(
            "pd_proxy_panic_routing",
            "Picks made with no eligible instance in the role: health and breaker ignored",
            ["role"],
            registry=r,
        )
        self.kv_releases = Counter(
            "pd_proxy_kv_releases",
            "Prefiller blocks released by the proxy (request ended between legs), by result",
            ["result"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "pd_proxy_client_disconnects",
            "Clients that hung up, by phase (body, prefill, between_legs, decode_first_byte,"
            " decode_stream, response)",
            ["phase"],
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "pd_proxy_prefill_seconds", "Prefill leg latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.decode_first_byte_seconds = Histogram(
            "pd_proxy_decode_first_byte_seconds",
            "Decode leg: time to its first body byte (non-streamed: the whole answer)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "pd_proxy_time_to_first_token_seconds",
            "End to end: request received to first body byte sent to the client",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_chunk_seconds = Histogram(
            "pd_proxy_inter_chunk_seconds",
            "Gaps between streamed chunks from the decoder",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.added_seconds = Histogram(
            "pd_proxy_added_seconds",
            "The proxy's own latency to first byte (time to first token minus upstream waits)",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.limit_hits = Counter(
            "pd_proxy_limit_hits",
            "Requests or connections stopped by a hardening limit (connections, header_timeout,"
            " body_timeout, body_size, write_timeout, upstream_pool)",
            ["limit"],
            registry=r,
        )
        if client_connections is not None:
            Gauge(
                "pd_proxy_client_connections", "Client connections open", registry=r
            ).set_function(client_connections)
        if instances is not None:
            r.register(_InstanceCollector(instances))
