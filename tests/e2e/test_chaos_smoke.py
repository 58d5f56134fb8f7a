"""The chaos soak's 3-minute smoke: 2P2D + proxy through one fault of each family.

Runs ``python -m scripts.chaos_soak --smoke`` (seeded) as its own process, as an operator
would: a SIGKILLed decoder mid-stream and its restart, a frozen prefiller, a blocked side
channel (two-host namespace lab, when root), client hang-ups mid-stream, 400 poison
requests and an admin remove/add, under Poisson load at concurrency 8. The soak exits
non-zero if an invariant fails (a hang, a broken answer, a wrong greedy answer, a leaked
KV block or held transfer, RSS growth, an error outside a fault window); its report is
printed on failure. About 4-5 minutes on 2 cores, most of it the 4 instances' start-up.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from scripts.pdlab import ROOT

pytestmark = pytest.mark.e2e

SEED = 3
LIMIT_S = 540  # start-up (~45-90 s) + 180 s load + quiescence; killed after this


@pytest.mark.timeout(LIMIT_S + 60)
def test_chaos_smoke(tmp_path):
    out = tmp_path / "chaos"
    argv = [sys.executable, "-m", "scripts.chaos_soak", "--smoke", "--seed", str(SEED)]
    argv += ["--out-dir", str(out)]
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        # SIGTERM: the soak stops its own children by PID and deletes its namespaces.
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=90)
        pytest.fail(f"chaos smoke ran past {LIMIT_S}s:\n{stdout[-4000:]}\n{stderr[-2000:]}")
    report = (out / "report.md").read_text() if (out / "report.md").exists() else stdout
    assert proc.returncode == 0, f"{report}\n--- stderr ---\n{stderr[-3000:]}"
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    faults = [e for e in events if e["type"] == "fault"]
    requests = [e for e in events if e["type"] == "request"]
    assert len(faults) >= 5, report  # the plan's faults ran
    assert any(f["kind"] == "kill_decode" and f["back"] is not None for f in faults), report
    assert sum(q["outcome"] == "ok" for q in requests) >= 100, report
    assert (out / "timeline.png").stat().st_size > 10_000
    assert "| PASS |" in report and "| FAIL |" not in report
