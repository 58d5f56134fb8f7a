"""Transfer stats: recorded by threads, aggregated by vLLM, exposed to Prometheus."""

from types import SimpleNamespace

import prometheus_client
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

from connector.recorder import TransferRecorder
from connector.stats import P2pConnectorStats, P2pPromMetrics


def test_recorder_takes_and_resets():
    rec = TransferRecorder()
    assert rec.take() is None
    rec.push(0.002, 4096, 2, 1)
    rec.pull(0.003, 4096)
    rec.event("expired", 2)
    data = rec.take()
    assert data["push_bytes"] == [4096] and data["expired"] == [1, 1]
    assert rec.take() is None
    with pytest.raises(KeyError):
        rec.event("nonsense")


def test_stats_aggregate_and_reduce():
    a, b = TransferRecorder(), TransferRecorder()
    a.push(0.001, 2**20, 4, 2)
    b.push(0.003, 2**20, 4, 4)
    b.event("push_failures")
    stats = P2pConnectorStats(data=a.take()).aggregate(P2pConnectorStats(data=b.take()))
    r = stats.reduce()
    assert r["Pushes"] == 2 and r["Push MB"] == 2.0 and r["Push segments"] == 6
    assert r["Push failures"] == 1 and r["Avg push ms"] == 2.0
    assert r["Push MB/s"] == pytest.approx(500.0)
    assert P2pConnectorStats().is_empty() and not stats.is_empty()


def test_prometheus_series():
    registry = prometheus_client.CollectorRegistry()
    counter = lambda *a, **k: prometheus_client.Counter(*a, registry=registry, **k)  # noqa: E731
    hist = lambda *a, **k: prometheus_client.Histogram(*a, registry=registry, **k)  # noqa: E731
    gauge = lambda *a, **k: prometheus_client.Gauge(*a, registry=registry, **k)  # noqa: E731
    cfg = SimpleNamespace(kv_transfer_config=None)  # the only field the base class reads
    types = {
        prometheus_client.Counter: counter,
        prometheus_client.Histogram: hist,
        prometheus_client.Gauge: gauge,
    }
    prom = P2pPromMetrics(cfg, types, ["model_name", "engine"], {0: ["m", "0"]})
    rec = TransferRecorder()
    rec.push(0.004, 8192, 2, 1)
    rec.event("refused", 3)
    prom.observe(rec.take(), 0)
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("vllm:pd_kv_pushed_bytes_total", labels) == 8192
    assert registry.get_sample_value("vllm:pd_kv_refused_total", labels) == 3
    assert registry.get_sample_value("vllm:pd_kv_push_seconds_count", labels) == 1
    assert KVConnectorProm  # the class vLLM uses to call build_prom_metrics


def test_gauges_ship_the_latest_level():
    rec = TransferRecorder()
    rec.gauge("held_requests", 3)
    rec.gauge("held_requests", 2)  # set twice between two steps: the last value ships
    data = rec.take()
    assert data["held_requests"] == [2] and rec.take() is None
    with pytest.raises(KeyError):
        rec.gauge("nonsense", 1)
    # A level that dropped to 0 is still news: the stats are not empty.
    rec.gauge("waiting_pulls", 0)
    stats = P2pConnectorStats(data=rec.take())
    assert not stats.is_empty() and stats.reduce()["Waiting pulls"] == 0


def test_gauge_series_follow_the_latest_aggregated_value():
    registry = prometheus_client.CollectorRegistry()
    types = {
        prometheus_client.Counter: lambda *a, **k: prometheus_client.Counter(
            *a, registry=registry, **k
        ),
        prometheus_client.Histogram: lambda *a, **k: prometheus_client.Histogram(
            *a, registry=registry, **k
        ),
        prometheus_client.Gauge: lambda *a, **k: prometheus_client.Gauge(
            *a, registry=registry, **k
        ),
    }
    cfg = SimpleNamespace(kv_transfer_config=None)
    prom = P2pPromMetrics(cfg, types, ["model_name", "engine"], {0: ["m", "0"]})
    labels = {"model_name": "m", "engine": "0"}
    a, b = TransferRecorder(), TransferRecorder()
    a.gauge("held_requests", 5)
    b.gauge("held_requests", 1)
    stats = P2pConnectorStats(data=a.take()).aggregate(P2pConnectorStats(data=b.take()))
    prom.observe(stats.data, 0)
    assert registry.get_sample_value("vllm:pd_kv_held_requests", labels) == 1
    # Steps that carry no level leave the gauge where it was.
    a.push(0.001, 10, 1, 1)
    prom.observe(a.take(), 0)
    assert registry.get_sample_value("vllm:pd_kv_held_requests", labels) == 1
    a.gauge("held_requests", 0)
    a.gauge("waiting_pulls", 0)
    prom.observe(a.take(), 0)
    assert registry.get_sample_value("vllm:pd_kv_held_requests", labels) == 0
    assert registry.get_sample_value("vllm:pd_kv_waiting_pulls", labels) == 0
