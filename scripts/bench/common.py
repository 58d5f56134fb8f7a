"""Helpers shared by the benchmarks: progress lines, machine load, robust statistics, tables."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"


def say(tag: str, msg: str) -> None:
    print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def loadavg() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pct(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); enough for the small samples used here."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, round(q / 100.0 * len(s) + 0.5) - 1))
    return s[k]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table, also readable on a terminal."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, r in enumerate(cells):
        lines.append("| " + " | ".join(c.rjust(widths[i]) for i, c in enumerate(r)) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fmt(c: object) -> str:
    if isinstance(c, float):
        if c != c:
            return "n/a"
        if abs(c) >= 100:
            return f"{c:.0f}"
        if abs(c) >= 10:
            return f"{c:.1f}"
        if abs(c) >= 1:
            return f"{c:.2f}"
        return f"{c:.3f}"
    return str(c)


def results_path(name: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / name
