"""The prefiller dies after handing out its KV handle: no decoder request may hang.

One prefiller, two decoders (``kv_load_failure_policy`` recompute and fail). Two prompts
are prefilled, the prefiller is killed (SIGKILL), then each decoder gets its request with
the now-dead handle. recompute: the decoder computes the prompt itself and answers exactly
what it answers without any handle; fail: the request ends with an error. Both within a
few seconds although the pull timeout is 30 s (the decoder sees the side channel refused
and gives up on a dead prefiller at once; measured ~1.0 s), and both decoders keep serving.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from scripts.pdlab import Lab, free_port, kv_config, prompt_tokens_by_source, vllm_child
from tests.e2e.cases import MODEL_DIR, answer_ids, completion_cases

pytestmark = pytest.mark.e2e

PULL_TIMEOUT_S = 30  # the default: dead-peer detection, not the timeout, must end the pull
DETECT_S = 5  # connection refused -> fail in ~1 s, plus one CPU prefill/decode on 2 cores


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("prefiller-dies")
    p = vllm_child(
        "prefill",
        "prefill",
        free_port(),
        log_dir,
        core=0,
        model_dir=MODEL_DIR,
        kv=kv_config("prefill", free_port()),
    )
    decoders = {}
    for policy, core in (("recompute", 1), ("fail", 1)):
        kv = kv_config("decode", free_port(), pull_timeout_s=PULL_TIMEOUT_S)
        kv["kv_load_failure_policy"] = policy
        decoders[policy] = vllm_child(
            f"decode-{policy}",
            "decode",
            free_port(),
            log_dir,
            core=core,
            model_dir=MODEL_DIR,
            kv=kv,
        )
    with Lab([p, *decoders.values()]) as lab:
        lab.start_all(timeout_s=300)
        yield p, decoders


def test_dead_prefiller_recompute_and_fail(lab):
    p, decoders = lab
    body = {"model": "tiny-llama", **completion_cases(32)["several_blocks"]}
    handles = {}
    with httpx.Client(timeout=60) as c:
        for policy in decoders:
            r = c.post(
                p.url + "/v1/completions",
                json={
                    **body,
                    "max_tokens": 1,
                    "min_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
                },
            )
            handles[policy] = r.json()["kv_transfer_params"]
            assert handles[policy]["transfer_secret"]
        # The whole instance dies at once (API server, engine core, workers), as on a crash;
        # killing only the API server would leave the engine core serving KV.
        os.killpg(p.pid, signal.SIGKILL)
        p.proc.wait(10)

        d = decoders["recompute"]
        before = prompt_tokens_by_source(c.get(d.url + "/metrics").text)
        t0 = time.monotonic()
        r = c.post(
            d.url + "/v1/completions", json={**body, "kv_transfer_params": handles["recompute"]}
        )
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        recomputed = answer_ids(r.json())
        after = prompt_tokens_by_source(c.get(d.url + "/metrics").text)
        assert after["local_compute"] - before["local_compute"] == len(body["prompt"])
        local = answer_ids(c.post(d.url + "/v1/completions", json=body).json())
        assert recomputed == local
        print(f"\nrecompute after the prefiller died: answered in {took:.2f}s")
        assert took < DETECT_S

        d = decoders["fail"]
        t0 = time.monotonic()
        r = c.post(d.url + "/v1/completions", json={**body, "kv_transfer_params": handles["fail"]})
        took = time.monotonic() - t0
        failed = r.status_code >= 400 or r.json()["choices"][0]["finish_reason"] == "error"
        assert failed, json.dumps(r.json())[:500]
        print(f"fail policy after the prefiller died: answered in {took:.2f}s")
        assert took < DETECT_S
        # The decoder is still healthy and serves the next request.
        assert c.get(d.url + "/health").status_code == 200
        assert answer_ids(c.post(d.url + "/v1/completions", json=body).json()) == local
    for d in decoders.values():
        assert "failed" in d.log_path.read_text()
