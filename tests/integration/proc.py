"""A worker process driven by JSON lines (tests/integration/*_proc.py), for tests."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class WorkerProc:
    """``module`` is started with ``cfg`` as JSON; it says ``{"event": "ready"}`` first."""

    def __init__(self, module: str, cfg: dict, ready_timeout: float = 60) -> None:
        self.cfg = cfg
        self.proc = subprocess.Popen(
            [sys.executable, "-m", f"tests.integration.{module}", json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            text=True,
            env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
        )
        assert self.read(ready_timeout)["event"] == "ready"

    def read(self, timeout: float = 20) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"{self.cfg.get('name', 'worker')} process did not answer"
        line = self.proc.stdout.readline()
        assert line, f"worker exited with {self.proc.poll()}"
        return json.loads(line)

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.call(cmd="quit")
            self.proc.wait(20)
