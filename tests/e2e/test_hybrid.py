"""A hybrid model (sliding-window + full attention groups) through 1P1D, token-exact.

The tiny hybrid Llama has layers [sliding, full, sliding, full] with a 64-token window,
so vLLM keeps two KV cache groups whose layers share memory on the CPU backend. Prompts
run far past the window; one shares a 300-token prefix with an earlier, longer prompt,
so the decoder's prefix cache is hit at a position whose sliding-window blocks were
never transferred.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import httpx
import pytest

from scripts.pdlab import (
    ROOT,
    pd_stack,
    prompt_tokens_by_source,
)
from tests.e2e.cases import MAX_TOKENS, answer_ids, reference

pytestmark = pytest.mark.e2e

HYBRID_DIR = ROOT / "models" / "tiny-hybrid"
BLOCK = 32
WINDOW = 64
LENGTHS = {"short": 20, "one_window": WINDOW, "past_window": 100, "long": 300, "longest": 700}


def cases() -> dict[str, dict[str, Any]]:
    vocab = int(json.loads((HYBRID_DIR / "config.json").read_text())["vocab_size"])
    out = {}
    for i, (name, n) in enumerate(LENGTHS.items()):
        rng = random.Random(77 + i)
        out[name] = [rng.randrange(3, vocab) for _ in range(n)]
    rng = random.Random(99)
    out["shares_300_with_longest"] = out["longest"][:300] + [
        rng.randrange(3, vocab) for _ in range(80)
    ]
    return {
        name: {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
        for name, ids in out.items()
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not (HYBRID_DIR / "config.json").exists():
        pytest.fail(f"no hybrid model at {HYBRID_DIR}: run scripts/setup.sh first")
    log_dir = tmp_path_factory.mktemp("hybrid")
    ref = reference(
        BLOCK, log_dir, HYBRID_DIR, {n: ("/v1/completions", b) for n, b in cases().items()}
    )
    pd = pd_stack(log_dir, block_size=BLOCK, model_dir=HYBRID_DIR)
    with pd.lab as lab:
        lab.start_all(timeout_s=300)
        yield {"proxy": pd.proxy.url, "decode": pd.decode.url, "log_dir": log_dir, "ref": ref}


def test_both_groups_are_registered_on_both_sides(stack):
    for side in ("prefill", "decode"):
        log = (stack["log_dir"] / f"{side}.log").read_text()
        assert f"registered KV group sliding:{WINDOW}" in log, side
        assert "registered KV group full" in log, side
        assert re.search(r"in 2 groups as \d+ spans", log), side


def test_hybrid_answers_match_colocated(stack):
    def sources() -> dict[str, float]:
        return prompt_tokens_by_source(httpx.get(stack["decode"] + "/metrics", timeout=10).text)

    before = sources()
    with httpx.Client(base_url=stack["proxy"], timeout=120) as c:
        for name, body in cases().items():  # "longest" goes before the prompt sharing its prefix
            r = c.post(
                "/v1/completions",
                json={"model": "tiny-llama", **body},
                headers={"x-request-id": f"hy-{name}"},
            )
            assert r.status_code == 200, r.text
            assert answer_ids(r.json()) == stack["ref"][name], name
    after = sources()
    assert after["local_compute"] - before["local_compute"] == 0
    assert after["external_kv_transfer"] > before["external_kv_transfer"]


def test_only_in_window_sliding_blocks_are_sent(stack):
    log = (stack["log_dir"] / "prefill.log").read_text()
    m = re.search(r"transfer cmpl-hy-longest\S*: pushed (\d+) blocks", log)
    assert m, "no push logged for the longest prompt"
    full_blocks = -(-LENGTHS["longest"] // BLOCK)
    sliding_blocks = int(m.group(1)) - full_blocks
    # The window covers at most cdiv(64, 32) + 1 slots; every other sliding slot is null.
    assert 1 <= sliding_blocks <= WINDOW // BLOCK + 1, m.group(0)
