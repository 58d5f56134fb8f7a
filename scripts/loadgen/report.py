"""Result files (JSON: every request of every phase) and the text tables printed from them."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts.loadgen.arrival import Level
from scripts.loadgen.records import RequestRecord
from scripts.loadgen.runner import PhaseResult
from scripts.loadgen.stats import Slo, summarize, timeseries

SCHEMA = "pd-loadgen/1"


@dataclass
class Phase:
    """A phase as stored: level, records and the summary computed from them."""

    level: Level
    records: list[RequestRecord]
    summary: dict[str, Any]
    t0_s: float = 0.0
    wall_s: float = 0.0
    stopped_by: str = "count"
    abort_reason: str | None = None
    timeseries: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class Result:
    meta: dict[str, Any]
    phases: list[Phase]

    @property
    def label(self) -> str:
        return str(self.meta.get("label") or "run")


def load_average() -> list[float] | None:
    """1/5/15-minute load: on a shared machine, the first thing to check on odd numbers."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def host_info() -> dict[str, Any]:
    return {
        "hostname": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": load_average(),
    }


def build_result(meta: dict[str, Any], phases: Sequence[PhaseResult], slo: Slo) -> Result:
    out = []
    for p in phases:
        out.append(
            Phase(
                level=p.level,
                records=p.records,
                summary=summarize(p.records, slo=slo),
                t0_s=p.t0_s,
                wall_s=p.wall_s,
                stopped_by=p.stopped_by,
                abort_reason=p.abort_reason,
                timeseries=timeseries(p.records),
            )
        )
    meta = {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **meta}
    return Result(meta, out)


def _clean(x: Any) -> Any:
    """JSON has no NaN/inf: write them as null / "inf" so any JSON reader accepts the file."""
    if isinstance(x, float):
        if math.isnan(x):
            return None
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_result(res: Result, path: Path, keep_text: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "meta": res.meta,
        "phases": [
            {
                "level": p.level.to_json(),
                "t0_s": p.t0_s,
                "wall_s": p.wall_s,
                "stopped_by": p.stopped_by,
                "abort_reason": p.abort_reason,
                "summary": p.summary,
                "timeseries": p.timeseries,
                "requests": [r.to_json(keep_text) for r in p.records],
            }
            for p in res.phases
        ],
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_clean(doc), indent=1, allow_nan=False))
    tmp.replace(path)
    return path


def _nan(x: Any) -> Any:
    if x is None:
        return math.nan
    if isinstance(x, dict):
        return {k: _nan(v) for k, v in x.items()}
    return x


def read_result(path: Path, slo: Slo | None = None) -> Result:
    """Load a result file; with ``slo``, summaries are recomputed (e.g. for new SLOs)."""
    doc = json.loads(Path(path).read_text())
    if doc.get("meta", {}).get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a {SCHEMA} result file")
    phases = []
    for p in doc["phases"]:
        records = [RequestRecord.from_json(r) for r in p["requests"]]
        summary = summarize(records, slo=slo) if slo is not None else p["summary"]
        for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            summary[k] = _nan(summary[k])
        phases.append(
            Phase(
                level=Level.from_json(p["level"]),
                records=records,
                summary=summary,
                t0_s=p.get("t0_s", 0.0),
                wall_s=p.get("wall_s", 0.0),
                stopped_by=p.get("stopped_by", "count"),
                abort_reason=p.get("abort_reason"),
                timeseries=p.get("timeseries") or timeseries(records),
            )
        )
    meta = doc["meta"]
    meta.setdefault("label", Path(path).stem)
    return Result(meta, phases)


# --- tables -------------------------------------------------------------------------------

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL"))
STATS = ("mean", "p50", "p90", "p99")


def metric_rows(summary: dict[str, Any]) -> list[tuple[str, float | str]]:
    """(name, value) rows of one summary, in the order tables print them."""
    g = summary.get("goodput") or {}
    rows: list[tuple[str, float | str]] = [
        ("completed", summary["completed"]),
        ("failed", summary["failed"]),
        ("cancelled at stop", summary["cancelled"]),
        ("duration (s)", summary["duration_s"]),
        ("requests/s", summary["request_throughput"]),
        ("output tokens/s", summary["output_throughput"]),
        ("total tokens/s", summary["total_token_throughput"]),
    ]
    for key, name in LATENCIES:
        for st in STATS:
            rows.append((f"{name} {st} (ms)", summary[key].get(st, math.nan)))
    if g.get("good") is not None:
        rows.append(("goodput share", _num(g.get("share"))))
        rows.append(("goodput (req/s)", _num(g.get("request_goodput"))))
    errors = summary.get("errors") or {}
    if errors:
        rows.append(("errors", ", ".join(f"{k}={v}" for k, v in errors.items())))
    return rows


def _num(x: Any) -> float:
    return math.nan if x is None else float(x)


def fmt(v: float | str | int) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, int):
        return str(v)
    if v is None or math.isnan(v):
        return "-"
    if math.isinf(v):
        return "inf"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def render(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    markdown: bool = False,
    left_cols: int = 1,
) -> str:
    """A plain or Markdown table; the first ``left_cols`` columns are labels (left-aligned)."""
    if markdown:
        lines = ["| " + " | ".join(headers) + " |"]
        lines.append(
            "|" + "|".join("---" if i < left_cols else "---:" for i in range(len(headers))) + "|"
        )
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=False)]
    out = [
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w)
            for i, (h, w) in enumerate(zip(headers, widths, strict=False))
        )
    ]
    out.append("  ".join("-" * w for w in widths))
    for r in rows:
        out.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=False))
            )
        )
    return "\n".join(out)


def summary_table(res: Result, markdown: bool = False) -> str:
    """One column per phase (load level)."""
    headers = ["metric", *(p.level.label for p in res.phases)]
    per_phase = [metric_rows(p.summary) for p in res.phases]
    names = list(dict.fromkeys(name for rows in per_phase for name, _ in rows))
    table = []
    for name in names:
        row = [name]
        for rows in per_phase:
            row.append(fmt(dict(rows).get(name, "")))
        table.append(row)
    return render(headers, table, markdown)
