"""Mooncake TCP throughput vs segment size, same bytes, two processes over loopback.

    .venv/bin/python -m scripts.bench.segment_sweep [--total-mib 1024] [--repeats 5]

Moves the same --total-mib bytes from this process's registered buffer into a buffer of a
subprocess engine (scripts.bench.push_target), cut into equal segments of each size in
--sizes-kib (the last size, 0, means one segment of everything), at most --max-segments
per batch_transfer_sync_write call. Sizes are timed interleaved in rotating order. Prints
median / p90 GB/s per size and the ratio to the single-segment write; draws the curve to
results/segment_sweep_<total>MiB.png. This is the engine's own shape, no connector code:
it shows where per-segment cost dominates (small) and what very large segments cost.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from scripts.bench.common import loadavg, median, pct, results_path, say, table
from scripts.bench.push_path import Target, mem_available

TAG = "sweep"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--total-mib", type=int, default=1024)
    ap.add_argument(
        "--sizes-kib", type=int, nargs="+", default=[8, 32, 128, 512, 2048, 8192, 32768, 131072, 0]
    )
    ap.add_argument("--max-segments", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from connector.transport import MooncakeTransport

    total = args.total_mib * 2**20
    if 2 * total + 4 * 2**30 > mem_available():
        raise SystemExit("not enough MemAvailable for 2 x --total-mib + 4 GiB margin")
    say(TAG, f"start: {loadavg()}; {args.total_mib} MiB per write")
    src = np.empty(total, dtype=np.uint8)
    src[:] = 7
    base = int(src.ctypes.data)
    target = Target(total)
    transport = MooncakeTransport("127.0.0.1", "tcp")
    plans: dict[str, list[tuple[list[int], list[int], list[int]]]] = {}
    sizes: dict[str, int] = {}
    try:
        transport.register([(base, total)])
        for kib in args.sizes_kib:
            seg = total if kib == 0 else kib * 1024
            name = "1 segment" if kib == 0 else f"{kib} KiB"
            offs = np.arange(0, total, seg, dtype=np.int64)
            lens = np.minimum(seg, total - offs)
            calls = []
            for lo in range(0, len(offs), args.max_segments):
                o = offs[lo : lo + args.max_segments]
                calls.append(
                    (
                        (base + o).tolist(),
                        (target.base + o).tolist(),
                        lens[lo : lo + args.max_segments].tolist(),
                    )
                )
            plans[name] = calls
            sizes[name] = seg

        def run(name: str) -> float:
            t = time.perf_counter()
            for s, d, n in plans[name]:
                transport.write(target.session, s, d, n)
            return time.perf_counter() - t

        for name in plans:  # warm-up, also connects
            run(name)
        times: dict[str, list[float]] = {k: [] for k in plans}
        names = list(plans)
        t0 = time.monotonic()
        for rnd in range(args.repeats):
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            for name in order:
                times[name].append(run(name))
            say(
                TAG,
                f"round {rnd + 1}/{args.repeats}: "
                + "  ".join(f"{k} {total / times[k][-1] / 1e9:.2f}" for k in names)
                + f" GB/s; {loadavg()}",
            )
            if time.monotonic() - t0 > args.budget_s:
                say(TAG, "time budget reached")
                break
    finally:
        transport.close()
        target.close()
    one = median(times[names[-1]])
    rows = []
    for k in names:
        segs = sum(len(c[0]) for c in plans[k])
        gbs = [total / t / 1e9 for t in times[k]]
        rows.append(
            [
                k,
                segs,
                len(plans[k]),
                len(times[k]),
                median(times[k]) * 1e3,
                pct(times[k], 90) * 1e3,
                median(gbs),
                min(gbs),
                max(gbs),
                one / median(times[k]),
                median([a / b for a, b in zip(times[names[-1]], times[k], strict=False)]),
                (median(times[k]) / segs) * 1e6,
            ]
        )
    say(TAG, f"done: {loadavg()}")
    print()
    print(
        table(
            [
                "segment",
                "segments",
                "calls",
                "reps",
                "ms (med)",
                "ms (p90)",
                "GB/s (med)",
                "GB/s (min)",
                "GB/s (max)",
                "speed vs 1 segment",
                "paired vs 1 segment",
                "us per segment",
            ],
            rows,
        )
    )
    print("paired = median over rounds of (1-segment time / this size's time) in the same round")
    if not args.no_plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(7, 4))
            xs = [sizes[k] / 1024 for k in names]
            for j in range(max(len(v) for v in times.values())):
                ax.scatter(
                    xs,
                    [total / times[k][j] / 1e9 if j < len(times[k]) else np.nan for k in names],
                    s=10,
                    color="0.6",
                )
            ax.plot(xs, [total / median(times[k]) / 1e9 for k in names], "o-", label="median")
            ax.set_xscale("log")
            ax.set_xlabel("segment size (KiB; rightmost = one segment)")
            ax.set_ylabel("GB/s")
            ax.set_title(
                f"Mooncake TCP loopback, {args.total_mib} MiB per write, "
                f"<= {args.max_segments} segments/call"
            )
            ax.legend()
            fig.tight_layout()
            path = results_path(f"segment_sweep_{args.total_mib}MiB.png")
            fig.savefig(path, dpi=100)
            say(TAG, f"plot: {path}")
        except ImportError:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
