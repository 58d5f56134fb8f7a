"""PNG plots of one result (distributions, timeline, sweep) and of a comparison.

matplotlib with the Agg backend: no display needed, safe in CI and over SSH.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from scripts.loadgen.compare import matched_levels
from scripts.loadgen.report import Phase, Result

_DPI = 110


def _ms(values: Sequence[float | None]) -> np.ndarray:
    return np.asarray([v * 1000.0 for v in values if v is not None], dtype=float)


def _series(p: Phase) -> dict[str, np.ndarray]:
    ok = [r for r in p.records if r.ok]
    return {
        "TTFT": _ms([r.ttft_s for r in ok]),
        "TPOT": _ms([r.tpot_s for r in ok]),
        "ITL": _ms([x for r in ok for x in r.itl_s]),
        "E2EL": _ms([r.e2el_s for r in ok]),
    }


def _cdf(ax: Any, values: np.ndarray, label: str, **kw: Any) -> None:
    if values.size == 0:
        return
    xs = np.sort(values)
    ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=label, **kw)


def _finish(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def plot_result(res: Result, out_dir: Path, stem: str) -> list[Path]:
    paths = [plot_distributions(res, out_dir / f"{stem}-distributions.png")]
    paths.append(plot_timeline(res, out_dir / f"{stem}-timeline.png"))
    if len(res.phases) > 1:
        paths.append(plot_sweep([res], out_dir / f"{stem}-sweep.png"))
    return paths


def plot_distributions(res: Result, path: Path) -> Path:
    """Histograms (TTFT, TPOT, ITL) and CDFs (TTFT, TPOT, E2EL), one colour per level."""
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    for p in res.phases:
        s = _series(p)
        for ax, key in zip(axes[0], ("TTFT", "TPOT", "ITL"), strict=False):
            if s[key].size:
                # Up to p99: a few stragglers would otherwise squash the body into one bar.
                top = float(np.percentile(s[key], 99)) or float(s[key].max()) or 1.0
                ax.hist(s[key], bins=40, range=(0.0, top), alpha=0.5, label=p.level.label)
        for ax, key in zip(axes[1], ("TTFT", "TPOT", "E2EL"), strict=False):
            _cdf(ax, s[key], p.level.label)
    for ax, key in zip(axes[0], ("TTFT", "TPOT", "ITL"), strict=False):
        ax.set_title(f"{key} distribution (up to p99)")
        ax.set_xlabel(f"{key} (ms)")
        ax.set_ylabel("requests" if key != "ITL" else "chunk gaps")
    for ax, key in zip(axes[1], ("TTFT", "TPOT", "E2EL"), strict=False):
        ax.set_title(f"{key} CDF")
        ax.set_xlabel(f"{key} (ms)")
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{res.label}: latency distributions ({res.meta.get('target', '')})")
    return _finish(fig, path)


def plot_timeline(res: Result, path: Path) -> Path:
    """Throughput, requests in flight and latency over the run's wall time, phase by phase."""
    fig, axes = plt.subplots(3, 1, figsize=(13, 9), sharex=True)
    for i, p in enumerate(res.phases):
        color = f"C{i}"
        ts = p.timeseries
        t = np.asarray(ts.get("t_s", []), dtype=float) + p.t0_s
        if t.size == 0:
            continue
        kw = {"drawstyle": "steps-post", "color": color, "label": p.level.label}
        axes[0].plot(t, ts["output_tokens_per_s"], **kw)
        axes[1].plot(t, ts["in_flight"], **kw)
        ok = [r for r in p.records if r.ok and r.e2el_s is not None]
        streamed = [r for r in ok if r.ttft_s is not None]
        if streamed:
            axes[2].scatter(
                [r.start_s + p.t0_s for r in streamed],
                _ms([r.ttft_s for r in streamed]),
                s=8,
                marker="o",
                color=color,
                label=f"TTFT {p.level.label}",
            )
        axes[2].scatter(
            [r.start_s + p.t0_s for r in ok],
            _ms([r.e2el_s for r in ok]),
            s=10,
            marker="x",
            color=color,
            alpha=0.45,
            label=f"E2EL {p.level.label}",
        )
        failed = [r for r in p.records if not r.ok]
        if failed:
            axes[2].scatter(
                [r.start_s + p.t0_s for r in failed],
                [0] * len(failed),
                s=24,
                marker="v",
                color="red",
                label=f"not ok {p.level.label}",
            )
        for ax in axes:
            ax.axvline(p.t0_s, color="grey", ls=":", lw=0.8)
    bucket = (res.phases[0].timeseries.get("bucket_s") or [1.0])[0] if res.phases else 1.0
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_title(f"output throughput over time ({bucket:g} s buckets)")
    axes[1].set_ylabel("mean requests in flight")
    axes[2].set_ylabel("latency (ms)")
    axes[2].set_title("latency by request start time (o TTFT, x E2EL)")
    axes[2].set_xlabel("seconds since the first measured request")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=4)
    fig.suptitle(f"{res.label}: over time")
    return _finish(fig, path)


def plot_sweep(results: Sequence[Result], path: Path) -> Path:
    """Latency percentiles and throughput against load level, one line per result."""
    levels = [label for label, _ in matched_levels(results)]
    x = np.arange(len(levels))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2el_ms", "E2EL"))
    for i, res in enumerate(results):
        color = f"C{i}"
        by_label = {p.level.label: p for p in res.phases}

        def val(label: str, key: str, stat: str | None, _m: dict[str, Phase] = by_label) -> float:
            p = _m.get(label)
            if p is None:
                return math.nan
            v = p.summary[key] if stat is None else p.summary[key].get(stat)
            return math.nan if v is None else float(v)

        for ax, (key, name) in zip(axes.flat, panels, strict=False):
            ax.plot(
                x,
                [val(lv, key, "p50") for lv in levels],
                "o-",
                color=color,
                label=f"{res.label} p50",
            )
            ax.plot(
                x,
                [val(lv, key, "p99") for lv in levels],
                "s--",
                color=color,
                alpha=0.7,
                label=f"{res.label} p99",
            )
            ax.set_title(f"{name} vs load")
            ax.set_ylabel(f"{name} (ms)")
        ax = axes[1][1]
        ax.plot(
            x,
            [val(lv, "output_throughput", None) for lv in levels],
            "o-",
            color=color,
            label=f"{res.label} output tok/s",
        )
        ax.set_title("output throughput vs load")
        ax.set_ylabel("output tokens/s")
    for ax in axes.flat:
        ax.set_xticks(x, levels, rotation=15, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(" vs ".join(r.label for r in results))
    return _finish(fig, path)


def plot_compare_cdfs(results: Sequence[Result], path: Path) -> Path:
    """TTFT, TPOT and E2EL CDFs per load level, one line per result."""
    levels = matched_levels(results)[:6]
    fig, axes = plt.subplots(len(levels), 3, figsize=(14, 3.2 * len(levels) + 0.6), squeeze=False)
    for row, (label, phases) in enumerate(levels):
        for i, (res, p) in enumerate(zip(results, phases, strict=False)):
            if p is None:
                continue
            s = _series(p)
            for ax, key in zip(axes[row], ("TTFT", "TPOT", "E2EL"), strict=False):
                _cdf(ax, s[key], res.label, color=f"C{i}")
        for ax, key in zip(axes[row], ("TTFT", "TPOT", "E2EL"), strict=False):
            ax.set_title(f"{label}: {key} CDF", fontsize=10)
            ax.set_xlabel(f"{key} (ms)")
            ax.set_ylabel("share")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.suptitle(" vs ".join(r.label for r in results))
    return _finish(fig, path)


def plot_compare(results: Sequence[Result], out_dir: Path, stem: str = "compare") -> list[Path]:
    return [
        plot_compare_cdfs(results, out_dir / f"{stem}-cdf.png"),
        plot_sweep(results, out_dir / f"{stem}-sweep.png"),
    ]
