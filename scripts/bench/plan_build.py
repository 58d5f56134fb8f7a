"""Transfer-plan building: the connector's vectorised numpy plan vs a plain Python loop.

    .venv/bin/python -m scripts.bench.plan_build [--sizes 1000 10000 100000] [--layers 32]

For each block count and id pattern, both builders get the same Python lists of block
ids (what vLLM hands the connector) and must produce identical segment lists (checked
before timing). Then both are timed interleaved (ref, vec, vec+lists, ref, ...), each
repeated until a per-case time budget or repeat cap is hit; the table shows the median
and the minimum per build, and the speed-up of medians.

"vectorised" = connector.plan.build_transfer_plan (numpy arrays).
"vec+lists"  = the same plus converting every batch of <= max_segments to Python lists,
               which is what the push path hands to batch_transfer_sync_write.
"python loop" = for each region (layer), for each KV-cache group, for each (src, dst)
               pair: merge contiguous runs in Python and append to src/dst/len lists
               (the straightforward seed implementation).
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from connector.plan import RegionLayout, build_transfer_plan
from scripts.bench.common import loadavg, median, say, table

TAG = "plan"
PATTERNS = ("contiguous", "runs8", "every-other", "random")


def python_loop_plan(
    groups: list[tuple[list[int], list[int]]], src: RegionLayout, dst: RegionLayout
) -> tuple[list[int], list[int], list[int]]:
    """The seed's approach: nested Python loops, contiguous-run merging by hand."""
    merge = src.block_stride == src.block_len and dst.block_stride == dst.block_len
    out_s: list[int] = []
    out_d: list[int] = []
    out_n: list[int] = []
    blen, sstr, dstr = src.block_len, src.block_stride, dst.block_stride
    for r in range(len(src.base_addrs)):
        sb, db = src.base_addrs[r], dst.base_addrs[r]
        for s_ids, d_ids in groups:
            run_s = run_d = run_n = 0
            for s, d in zip(s_ids, d_ids, strict=True):
                if run_n and merge and s == run_s + run_n and d == run_d + run_n:
                    run_n += 1
                    continue
                if run_n:
                    out_s.append(sb + run_s * sstr)
                    out_d.append(db + run_d * dstr)
                    out_n.append(run_n * blen)
                run_s, run_d, run_n = s, d, 1
            if run_n:
                out_s.append(sb + run_s * sstr)
                out_d.append(db + run_d * dstr)
                out_n.append(run_n * blen)
    return out_s, out_d, out_n


def vectorised_plan(groups, src, dst):
    plans = [build_transfer_plan(s, d, src, dst) for s, d in groups]
    if len(plans) == 1:
        return plans[0].src, plans[0].dst, plans[0].lengths
    return (
        np.concatenate([p.src for p in plans]),
        np.concatenate([p.dst for p in plans]),
        np.concatenate([p.lengths for p in plans]),
    )


def vectorised_lists(groups, src, dst, max_segments: int) -> int:
    n = 0
    for s, d in groups:
        for bs, _bd, _bl in build_transfer_plan(s, d, src, dst).batches(max_segments):
            n += len(bs)
    return n


def block_ids(pattern: str, n: int, num_blocks: int, rng: random.Random) -> tuple[list, list]:
    if pattern == "contiguous":
        return list(range(1, n + 1)), list(range(n + 1, 2 * n + 1))
    if pattern == "every-other":
        return list(range(1, 2 * n, 2)), list(range(2, 2 * n + 1, 2))
    if pattern == "random":
        return rng.sample(range(1, num_blocks), n), rng.sample(range(1, num_blocks), n)
    if pattern == "runs8":
        # A fragmented free list: runs of 1..15 consecutive blocks (mean 8) at random places,
        # drawn independently on each side.
        def side() -> list[int]:
            out: list[int] = []
            starts = rng.sample(range(1, num_blocks - 16, 16), n // 4 + 2)
            for st in starts:
                out.extend(range(st, st + rng.randint(1, 15)))
                if len(out) >= n:
                    break
            if len(out) < n:
                raise AssertionError("runs8: not enough blocks drawn")
            return out[:n]

        return side(), side()
    raise ValueError(pattern)


def split_groups(src: list[int], dst: list[int], k: int) -> list[tuple[list[int], list[int]]]:
    step = (len(src) + k - 1) // k
    return [(src[i : i + step], dst[i : i + step]) for i in range(0, len(src), step)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--layers", type=int, default=32, help="regions (one per layer on CPU)")
    ap.add_argument("--groups", type=int, default=1, help="KV-cache groups the ids are split in")
    ap.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    ap.add_argument("--block-len", type=int, default=512 * 1024, help="bytes per block/region")
    ap.add_argument("--max-segments", type=int, default=1000)
    ap.add_argument("--min-repeats", type=int, default=3)
    ap.add_argument("--max-repeats", type=int, default=25)
    ap.add_argument("--budget-s", type=float, default=4.0, help="time per case (all variants)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    say(TAG, f"start: {loadavg()}")
    rows = []
    t_start = time.monotonic()
    for n in args.sizes:
        num_blocks = 8 * n + 64
        stride = args.block_len
        src_l = RegionLayout(
            tuple(0x10_0000_0000 + r * num_blocks * stride for r in range(args.layers)),
            args.block_len,
            stride,
            num_blocks,
        )
        dst_l = RegionLayout(
            tuple(0x9000_0000_0000 + r * num_blocks * stride for r in range(args.layers)),
            args.block_len,
            stride,
            num_blocks,
        )
        for pattern in args.patterns:
            s_ids, d_ids = block_ids(pattern, n, num_blocks, rng)
            groups = split_groups(s_ids, d_ids, args.groups)
            ref = python_loop_plan(groups, src_l, dst_l)
            vec = vectorised_plan(groups, src_l, dst_l)
            got = [a.tolist() for a in vec]
            if args.groups == 1:
                same = list(ref) == got
            else:  # group-major vs region-major order: compare as sets of triples
                same = sorted(zip(*ref, strict=True)) == sorted(zip(*got, strict=True))
            if not same:
                raise SystemExit(f"MISMATCH for n={n} {pattern}: plans differ")
            nseg = len(ref[0])
            del ref, got, vec
            times: dict[str, list[float]] = {"loop": [], "vec": [], "veclist": []}
            t_case = time.monotonic()
            for rep in range(args.max_repeats):
                t0 = time.perf_counter()
                python_loop_plan(groups, src_l, dst_l)
                t1 = time.perf_counter()
                vectorised_plan(groups, src_l, dst_l)
                t2 = time.perf_counter()
                vectorised_lists(groups, src_l, dst_l, args.max_segments)
                t3 = time.perf_counter()
                times["loop"].append(t1 - t0)
                times["vec"].append(t2 - t1)
                times["veclist"].append(t3 - t2)
                if rep + 1 >= args.min_repeats and time.monotonic() - t_case > args.budget_s:
                    break
            m = {k: median(v) * 1e3 for k, v in times.items()}
            mn = {k: min(v) * 1e3 for k, v in times.items()}
            rows.append(
                [
                    n,
                    args.layers,
                    pattern,
                    nseg,
                    len(times["loop"]),
                    m["loop"],
                    mn["loop"],
                    m["vec"],
                    mn["vec"],
                    m["veclist"],
                    m["loop"] / m["vec"],
                    m["loop"] / m["veclist"],
                ]
            )
            say(
                TAG,
                f"n={n:>6} {pattern:<11} segments={nseg:>8} reps={len(times['loop']):>2} "
                f"loop {m['loop']:9.3f} ms  vec {m['vec']:8.3f} ms  "
                f"vec+lists {m['veclist']:8.3f} ms"
                f"  x{m['loop'] / m['vec']:.0f}  (identical plans: yes)",
            )
    say(TAG, f"done in {time.monotonic() - t_start:.0f}s: {loadavg()}")
    print()
    print(
        table(
            [
                "blocks",
                "layers",
                "pattern",
                "segments",
                "reps",
                "loop ms (med)",
                "loop ms (min)",
                "vec ms (med)",
                "vec ms (min)",
                "vec+lists ms (med)",
                "speed-up vec",
                "speed-up vec+lists",
            ],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
