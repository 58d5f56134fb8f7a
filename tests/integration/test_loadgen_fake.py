"""pd-loadgen end to end against a FAKE OpenAI server (tests/fake_openai_stream.py):
request counts, bounds (count, deadline, failing or unreachable target) and files written.

The generator, its HTTP client and the files are real; only the server is a fake, so the
exact cases (hangs, 500s, cut streams) can be driven.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.loadgen.cli import EXIT_OK, EXIT_TARGET, main
from scripts.pdlab import DEFAULT_MODEL, free_port
from tests.fake_openai_stream import FakeOpenAIStream
from tests.servers import serve

pytestmark = pytest.mark.skipif(
    not (DEFAULT_MODEL / "tokenizer.json").exists(), reason="tiny model not built"
)


@pytest.fixture
def fake() -> Iterator[tuple[FakeOpenAIStream, str]]:
    f = FakeOpenAIStream(first_delay_s=0.02, token_delay_s=0.004)
    with serve(f.app) as url:
        yield f, url


def run(url: str, out: Path, *args: str) -> int:
    return main(
        ["run", "--base-url", url, "--out-dir", str(out), "--label", "t", "--no-progress", *args]
    )


def load(out: Path) -> dict:
    return json.loads((out / "t.json").read_text())


def test_sweep_counts_usage_and_files(fake: tuple[FakeOpenAIStream, str], tmp_path: Path) -> None:
    f, url = fake
    t0 = time.monotonic()
    code = run(
        url,
        tmp_path,
        "--concurrency",
        "1,3",
        "--num-requests",
        "12",
        "--warmup",
        "2",
        "--input-len",
        "20-40",
        "--output-len",
        "5-9",
        "--slo-ttft-ms",
        "5000",
        "--slo-tpot-ms",
        "1000",
    )
    assert code == EXIT_OK
    assert time.monotonic() - t0 < 60
    assert len(f.received) == 2 + 2 * 12  # warm-up + exactly the budget per level
    assert f.max_in_flight <= 3
    for r in f.received:
        assert r["body"]["stream"] is True
        assert r["body"]["stream_options"] == {"include_usage": True}
    doc = load(tmp_path)
    assert doc["meta"]["model"] == "fake-tiny"
    assert [p["level"]["label"] for p in doc["phases"]] == ["conc=1", "conc=3"]
    for phase in doc["phases"]:
        s = phase["summary"]
        assert (s["requests"], s["completed"], s["failed"]) == (12, 12, 0)
        assert phase["stopped_by"] == "count"
        assert s["goodput"]["share"] == 1.0
        for req in phase["requests"]:
            assert req["output_tokens"] == req["requested_output_tokens"]
            assert req["output_tokens_from"] == "usage"
            assert len(req["itl_s"]) == req["output_tokens"] - 1
            assert 0 < req["ttft_s"] <= req["e2el_s"]
            assert req["tpot_s"] > 0
    for name in ("t-distributions.png", "t-timeline.png", "t-sweep.png"):
        assert (tmp_path / name).stat().st_size > 10_000


def test_rate_mode_paces_arrivals(fake: tuple[FakeOpenAIStream, str], tmp_path: Path) -> None:
    f, url = fake
    code = run(
        url,
        tmp_path,
        "--rate",
        "20",
        "--arrival",
        "constant",
        "--num-requests",
        "10",
        "--warmup",
        "0",
        "--output-len",
        "3",
        "--no-plots",
    )
    assert code == EXIT_OK
    times = [r["t"] for r in f.received]
    assert len(times) == 10
    assert times[-1] - times[0] == pytest.approx(9 * 0.05, abs=0.15)


def test_chat_not_streamed(fake: tuple[FakeOpenAIStream, str], tmp_path: Path) -> None:
    f, url = fake
    code = run(
        url,
        tmp_path,
        "--endpoint",
        "chat",
        "--no-stream",
        "--concurrency",
        "2",
        "--num-requests",
        "4",
        "--warmup",
        "0",
        "--output-len",
        "4",
        "--no-plots",
    )
    assert code == EXIT_OK
    assert all(r["path"] == "/v1/chat/completions" for r in f.received)
    assert all("stream_options" not in r["body"] for r in f.received)
    reqs = load(tmp_path)["phases"][0]["requests"]
    assert all(
        r["status"] == "ok" and r["ttft_s"] is None and r["output_tokens"] == 4 for r in reqs
    )


def test_multi_turn_sends_history(fake: tuple[FakeOpenAIStream, str], tmp_path: Path) -> None:
    f, url = fake
    code = run(
        url,
        tmp_path,
        "--endpoint",
        "chat",
        "--workload",
        "multi-turn",
        "--turns",
        "3",
        "--concurrency",
        "1",
        "--num-requests",
        "3",
        "--warmup",
        "0",
        "--no-plots",
    )
    assert code == EXIT_OK
    assert [len(r["body"]["messages"]) for r in f.received] == [1, 3, 5]
    assert f.received[1]["body"]["messages"][1]["content"].startswith("tok")


def test_deadline_cuts_a_hanging_target(fake: tuple[FakeOpenAIStream, str], tmp_path: Path) -> None:
    f, url = fake
    f.behavior["hang"] = 4.0  # longer than the 1.5 s phase
    t0 = time.monotonic()
    code = run(
        url,
        tmp_path,
        "--concurrency",
        "4",
        "--num-requests",
        "100",
        "--duration",
        "1.5",
        "--warmup",
        "0",
        "--no-plots",
    )
    took = time.monotonic() - t0
    assert code == EXIT_OK
    assert took < 15  # 1.5 s of load + tokenizer/startup, never the 300 s request timeout
    phase = load(tmp_path)["phases"][0]
    assert phase["stopped_by"] == "deadline"
    assert phase["summary"]["cancelled"] == 4 and phase["summary"]["requests"] == 4
    assert len(f.received) == 4


def test_failing_target_ends_the_run(fake: tuple[FakeOpenAIStream, str], tmp_path: Path) -> None:
    f, url = fake
    f.behavior["status"] = 503
    code = run(
        url,
        tmp_path,
        "--concurrency",
        "2",
        "--num-requests",
        "200",
        "--warmup",
        "0",
        "--max-consecutive-failures",
        "5",
        "--no-plots",
    )
    assert code == EXIT_TARGET
    assert len(f.received) < 10  # stopped after 5 in a row (+ what was in flight)
    phase = load(tmp_path)["phases"][0]
    assert phase["stopped_by"] == "aborted"
    assert "in a row failed" in phase["abort_reason"]
    assert phase["summary"]["errors"] == {"http_503": phase["summary"]["failed"]}


def test_all_warmup_failures_end_the_run(
    fake: tuple[FakeOpenAIStream, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f, url = fake
    f.behavior["drop_after"] = 2  # streams cut before [DONE]
    code = run(url, tmp_path, "--concurrency", "1", "--warmup", "2", "--no-plots")
    assert code == EXIT_TARGET
    assert "truncated_stream" in capsys.readouterr().err
    assert len(f.received) == 2


def test_unreachable_target_fails_fast(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    code = run(f"http://127.0.0.1:{free_port()}", tmp_path, "--no-plots")
    assert code == EXIT_TARGET
    assert time.monotonic() - t0 < 30
    assert "cannot reach" in capsys.readouterr().err


def test_compare_two_results(
    fake: tuple[FakeOpenAIStream, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f, url = fake
    common = ["--concurrency", "2", "--num-requests", "6", "--warmup", "0", "--no-plots"]
    assert (
        main(["run", "--base-url", url, "--label", "a", "--out-dir", str(tmp_path), *common]) == 0
    )
    f.token_delay_s *= 3
    assert (
        main(["run", "--base-url", url, "--label", "b", "--out-dir", str(tmp_path), *common]) == 0
    )
    capsys.readouterr()
    code = main(
        [
            "compare",
            str(tmp_path / "a.json"),
            str(tmp_path / "b.json"),
            "--out-dir",
            str(tmp_path),
            "--full",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "b/a" in out and "TPOT p50 (ms)" in out and "conc=2" in out
    assert (tmp_path / "compare-cdf.png").stat().st_size > 10_000
    assert (tmp_path / "compare-sweep.png").stat().st_size > 10_000
