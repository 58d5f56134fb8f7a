"""Side-by-side comparison of two or more result files (e.g. colocated vs 1P1D)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from scripts.loadgen.report import Phase, Result, fmt, metric_rows, render

# The headline: medians (and p99) of the latencies plus throughput, per load level.
HEADLINE: tuple[tuple[str, str, str], ...] = (
    ("TTFT p50 (ms)", "ttft_ms", "p50"),
    ("TTFT p99 (ms)", "ttft_ms", "p99"),
    ("TPOT p50 (ms)", "tpot_ms", "p50"),
    ("TPOT p99 (ms)", "tpot_ms", "p99"),
    ("ITL p50 (ms)", "itl_ms", "p50"),
    ("E2EL p50 (ms)", "e2el_ms", "p50"),
    ("requests/s", "request_throughput", ""),
    ("output tokens/s", "output_throughput", ""),
)


def matched_levels(results: Sequence[Result]) -> list[tuple[str, list[Phase | None]]]:
    """Phases grouped by level label (in the first file's order), None where one is missing."""
    labels: list[str] = []
    for res in results:
        for p in res.phases:
            if p.level.label not in labels:
                labels.append(p.level.label)
    out = []
    for label in labels:
        row: list[Phase | None] = []
        for res in results:
            row.append(next((p for p in res.phases if p.level.label == label), None))
        out.append((label, row))
    return out


def ratio(a: float, b: float) -> float:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or a == 0:
        return math.nan
    return b / a


def fmt_ratio(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}x"


def headline_value(p: Phase | None, key: str, stat: str) -> float:
    if p is None:
        return math.nan
    v = p.summary.get(key)
    if stat:
        v = (v or {}).get(stat)
    return math.nan if v is None else float(v)


def headline_table(results: Sequence[Result], markdown: bool = False) -> str:
    """Per level and headline metric: each file's value and each file's ratio to the first."""
    labels = [r.label for r in results]
    headers = ["load", "metric", *labels, *(f"{b}/{labels[0]}" for b in labels[1:])]
    rows = []
    for level, phases in matched_levels(results):
        for name, key, stat in HEADLINE:
            vals = [headline_value(p, key, stat) for p in phases]
            rows.append(
                [
                    level,
                    name,
                    *(fmt(v) for v in vals),
                    *(fmt_ratio(ratio(vals[0], v)) for v in vals[1:]),
                ]
            )
    return render(headers, rows, markdown, left_cols=2)


def full_table(results: Sequence[Result], markdown: bool = False) -> str:
    """Every metric of every level, files side by side, ratios to the first file."""
    labels = [r.label for r in results]
    blocks = []
    for level, phases in matched_levels(results):
        per = [dict(metric_rows(p.summary)) if p else {} for p in phases]
        names = list(dict.fromkeys(n for d in per for n in d))
        rows = []
        for n in names:
            vals = [d.get(n, math.nan) for d in per]
            ratios = [
                fmt_ratio(ratio(vals[0], v))  # type: ignore[arg-type]
                if all(isinstance(x, (int, float)) for x in (vals[0], v))
                else ""
                for v in vals[1:]
            ]
            rows.append([n, *(fmt(v) for v in vals), *ratios])
        headers = [f"[{level}]", *labels, *(f"{b}/{labels[0]}" for b in labels[1:])]
        blocks.append(render(headers, rows, markdown))
    return "\n\n".join(blocks)
