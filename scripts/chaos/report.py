"""The soak's tables (Markdown) and timeline plot (PNG)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scripts.chaos.invariants import Check, FaultTiming

COLOURS = {
    "ok": "tab:green",
    "error": "tab:orange",
    "broken": "tab:red",
    "hang": "black",
    "cancelled": "tab:blue",
    "wrong": "magenta",
}


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def invariant_table(checks: Sequence[Check]) -> str:
    rows = ["| invariant | result | numbers |", "|---|---|---|"]
    rows += [f"| {c.name} | {c.verdict} | {c.detail} |" for c in checks]
    return "\n".join(rows)


def fault_table(timings: Sequence[FaultTiming]) -> str:
    rows = [
        "| # | fault | target | start s | back s | detect s | proxy up s | recover s | "
        "requests | unexpected errors | intended | notes |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for t in timings:
        notes = "; ".join(t.notes).replace("|", "/")
        rows.append(
            f"| {t.index} | {t.kind} | {t.target} | {t.start:.1f} | {_fmt(t.back)} | "
            f"{_fmt(t.detect_s)} | {_fmt(t.proxy_up_s)} | {_fmt(t.recover_s)} | "
            f"{t.requests} | {t.errors} | "
            f"{t.expected_errors} | {notes} |"
        )
    return "\n".join(rows)


def outcome_counts(reqs: Sequence[dict[str, Any]]) -> dict[str, int]:
    c = Counter(r["outcome"] for r in reqs)
    c["wrong"] = sum(1 for r in reqs if r.get("match") is False)
    return dict(c)


def plot(
    path: Path,
    reqs: Sequence[dict[str, Any]],
    faults: Sequence[dict[str, Any]],
    title: str,
) -> None:
    """Each request a horizontal line from start to end, coloured by outcome, stacked by
    start order; fault windows shaded and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(16, 7))
    for i, f in enumerate(faults):
        end = f.get("settle_end") or f.get("end") or f["start"]
        ax.axvspan(f["start"], end, color="tab:gray", alpha=0.18 if i % 2 else 0.28, lw=0)
        ax.text(
            f["start"],
            1.0,
            f"{f['index']}:{f['kind']}" + (f" {f['name']}" if f.get("name") else ""),
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            transform=ax.get_xaxis_transform(),
        )
        if f.get("back") is not None:
            ax.axvline(f["back"], color="tab:gray", lw=0.6, ls="--")
    ordered = sorted(reqs, key=lambda r: r["start"])
    for y, r in enumerate(ordered):
        outcome = "wrong" if r.get("match") is False else r["outcome"]
        end = r.get("end") if r.get("end") is not None else r["start"]
        ax.hlines(y, r["start"], end, color=COLOURS.get(outcome, "gray"), lw=0.8)
        if outcome != "ok":
            ax.plot(
                end,
                y,
                marker="x" if outcome != "cancelled" else ".",
                color=COLOURS.get(outcome, "gray"),
                ms=4,
            )
    counts = outcome_counts(reqs)
    handles = [
        plt.Line2D([0], [0], color=c, lw=3, label=f"{k} ({counts.get(k, 0)})")
        for k, c in COLOURS.items()
    ]
    ax.legend(handles=handles, loc="lower right", fontsize=8)
    ax.set_xlabel("seconds since load start (grey: fault windows incl. settle; dashed: back)")
    ax.set_ylabel("requests (by start time)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
