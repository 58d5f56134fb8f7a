"""Requests used by the end-to-end tests, and their colocated greedy answers.

The reference answers come from one plain vLLM instance (no connector) per block size,
computed once per test session and shared by every e2e module.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import httpx

from scripts.pdlab import DEFAULT_MODEL, Lab, free_port, vllm_child

MODEL_DIR = Path(os.environ.get("MODEL_DIR", DEFAULT_MODEL))
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


_references: dict[tuple[str, int], dict[str, list[int]]] = {}


def reference(
    block_size: int,
    log_dir: Path,
    model_dir: Path = MODEL_DIR,
    cases: dict[str, tuple[str, dict[str, Any]]] | None = None,
) -> dict[str, list[int]]:
    """Greedy answers of one colocated instance (no connector), computed once per model and
    block size. ``cases``: name -> (path, body); default: the completion and chat cases."""
    key = (str(model_dir), block_size)
    if key in _references:
        return _references[key]
    if cases is None:
        cases = {n: ("/v1/completions", b) for n, b in completion_cases(block_size).items()}
        cases |= {n: ("/v1/chat/completions", b) for n, b in chat_cases().items()}
    port = free_port()
    child = vllm_child(
        f"colocated-{model_dir.name}-bs{block_size}",
        "colocated",
        port,
        log_dir,
        core=0,
        block_size=block_size,
        model_dir=model_dir,
    )
    out: dict[str, list[int]] = {}
    with Lab([child]) as lab:
        lab.start_all(timeout_s=300)
        with httpx.Client(base_url=child.url, timeout=120) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            for name, (path, body) in cases.items():
                out[name] = answer_ids(c.post(path, json={"model": model, **body}).json())
    _references[key] = out
    return out


def prompt_len(name: str, block_size: int) -> int:
    return prompt_lengths(block_size)[name]
