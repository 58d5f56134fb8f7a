"""The whole push path vs the raw Mooncake ceiling, two processes over loopback TCP.

    .venv/bin/python -m scripts.bench.push_path --model tiny            # 8k tokens, 2 layers
    .venv/bin/python -m scripts.bench.push_path --model 7b --patterns contiguous shuffled
    .venv/bin/python -m scripts.bench.push_path --model 7b --tokens 4096   # + every-other

The receiving KV memory lives in a subprocess with its own transfer engine
(scripts.bench.push_target); this process holds the sending KV memory (CPU layout: one
allocation, one region per layer, blocks packed) and its own engine, like a prefiller.
Variants, timed interleaved in rotating order, each repeated:

  ceiling-1seg      one batch_transfer_sync_write of all the request's bytes as ONE segment
                    (the raw engine ceiling the issue asks for)
  ceiling-layers    one call with one segment per layer (the best any plan can do when each
                    layer's blocks are a separate byte range, as in vLLM's CPU layout)
  push-<pattern>    connector.sender.PushHandler.serve() with a real SendRegistry and
                    MooncakeTransport.write: claim, align, build_transfer_plan, batches of
                    <= --max-segments, write. Source blocks are 0..n-1 (contiguous); the
                    decoder-side block ids follow the pattern:
                      contiguous   0..n-1            -> 1 segment per layer
                      shuffled     a permutation     -> ~1 segment per block per layer
                      every-other  1,3,...,2n-1      -> 1 segment per block per layer

Each push variant is checked byte-exact on sampled blocks (crc32 on both sides) before
timing. Prints per-variant median / p90 GB/s, the ratio to both ceilings, segments, calls,
and a cost model (ceiling time + per-segment and per-call overhead fitted on this run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import subprocess
import sys
import time
import zlib

import numpy as np

from scripts.bench.common import ROOT, loadavg, median, pct, results_path, say, table

TAG = "push"
MODELS = {
    # name: (layers, kv_heads, block_size, 2*head_dim) on vLLM's CPU layout, bf16
    "tiny": (2, 2, 32, 64),  # models/tiny-llama: 8 KiB per block and layer
    "7b": (32, 32, 32, 256),  # Llama-2-7B (MHA, 32 heads x 128): 512 KiB per block and layer
}
PATTERNS = ("contiguous", "shuffled", "every-other")


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class Target:
    """The receiving process: its own engine and registered, resident memory."""

    def __init__(self, nbytes: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "scripts.bench.push_target", json.dumps({"bytes": nbytes})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            text=True,
            env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
        )
        hello = self.read(120)
        if "error" in hello:
            raise RuntimeError(f"target failed: {hello['error']}")
        self.session: str = hello["session"]
        self.base: int = hello["base"]

    def read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError("target process did not answer")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"target exited with {self.proc.poll()}")
        return json.loads(line)

    def call(self, timeout: float = 60, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(cmd="quit", timeout=20)
                self.proc.wait(20)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)


class Pusher:
    describe = ""

    def push(self, src_ids: list[int], dst_ids: list[int]) -> tuple[float, int, int]:
        """One request's push: (seconds, segments, bytes)."""
        raise NotImplementedError


class ReplicaPusher(Pusher):
    """PushHandler._push's sequence without the registry: plan, batches, write."""

    def __init__(self, local, remote, transport, session, max_segments) -> None:
        self.local, self.remote, self.transport = local, remote, transport
        self.session, self.max_segments = session, max_segments
        self.describe = "replica: build_transfer_plan + TransferPlan.batches + transport.write"

    def push(self, src_ids, dst_ids):
        from connector.plan import build_transfer_plan

        t = time.perf_counter()
        plan = build_transfer_plan(src_ids, dst_ids, self.local, self.remote)
        for s, d, n in plan.batches(self.max_segments):
            self.transport.write(self.session, s, d, n)
        return time.perf_counter() - t, len(plan), plan.total_bytes


class HandlerPusher(Pusher):
    """connector.sender.PushHandler with a real SendRegistry, as the side channel calls it."""

    def __init__(self, local, remote, block_size, transport, session, max_segments) -> None:
        from connector import wire
        from connector.layout import GroupLayout, geometry
        from connector.recorder import TransferRecorder
        from connector.send_registry import SendRegistry
        from connector.sender import InlineExecutor, PushHandler, PushLimits

        self.wire = wire
        self.registry = SendRegistry(expiry_s=600)
        self.session = session
        self.k = 0
        self.recorder = TransferRecorder()
        self.handler = PushHandler(
            self.registry,
            (GroupLayout("full", block_size, local),),
            transport.write,
            PushLimits(ready_timeout_s=5.0, max_segments_per_batch=max_segments),
            self.recorder,
            InlineExecutor(),
        )
        self.geometry = [geometry(GroupLayout("full", block_size, remote))]
        self.describe = "connector.sender.PushHandler.accept + SendRegistry"

    def push(self, src_ids, dst_ids):
        self.k += 1
        tid = f"bench-{self.k}"
        w = self.wire
        self.registry.add(tid, [src_ids], "s3cret")
        req = w.PullRequest(
            version=w.PROTOCOL_VERSION,
            msg_id=self.k,
            decoder_engine_id="bench-decoder",
            decoder_session=self.session,
            groups=self.geometry,
            deadline_ms=int((time.time() + 600) * 1000),
            items=[w.PullItem(tid, "s3cret", [dst_ids])],
        )
        replies: list = []
        t = time.perf_counter()
        self.handler.accept(req, replies.append)
        dt = time.perf_counter() - t
        if len(replies) != 1 or not replies[0].ok:
            raise RuntimeError(f"push failed: {replies}")
        self.registry.take_finished()
        self.recorder.take()
        return dt, replies[0].num_segments, replies[0].num_bytes


def split_segments(src, dst, lengths, cap: int):
    """Cut every segment longer than ``cap`` bytes into cap-sized pieces (vectorised).

    What the proposed connector change (a per-segment byte cap on TCP) would do to a plan.
    """
    import numpy as np

    pieces = -(-lengths // cap)
    idx = np.repeat(np.arange(lengths.size), pieces)
    first = np.cumsum(pieces) - pieces
    off = (np.arange(idx.size) - first[idx]) * cap
    return src[idx] + off, dst[idx] + off, np.minimum(cap, lengths[idx] - off)


class CappedPusher(Pusher):
    """The replica's sequence plus split_segments: the proposed change, measured."""

    def __init__(self, local, remote, transport, session, max_segments, cap: int) -> None:
        self.local, self.remote, self.transport = local, remote, transport
        self.session, self.max_segments, self.cap = session, max_segments, cap
        self.describe = f"replica + segments capped at {cap} B"

    def push(self, src_ids, dst_ids):
        from connector.plan import TransferPlan, build_transfer_plan

        t = time.perf_counter()
        plan = build_transfer_plan(src_ids, dst_ids, self.local, self.remote)
        plan = TransferPlan(*split_segments(plan.src, plan.dst, plan.lengths, self.cap))
        for s, d, n in plan.batches(self.max_segments):
            self.transport.write(self.session, s, d, n)
        return time.perf_counter() - t, len(plan), plan.total_bytes


def make_pusher(path, local, remote, block_size, transport, session, max_segments) -> Pusher:
    if path in ("auto", "handler"):
        try:
            return HandlerPusher(local, remote, block_size, transport, session, max_segments)
        except (TypeError, ImportError, AttributeError) as exc:
            if path == "handler":
                raise
            say(TAG, f"PushHandler API not recognised ({exc}); falling back to the replica")
    return ReplicaPusher(local, remote, transport, session, max_segments)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--patterns", nargs="+", choices=PATTERNS, default=list(PATTERNS))
    ap.add_argument(
        "--repeats", type=int, default=None, help="timed rounds (default 25 tiny, 5 7b)"
    )
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop timing rounds after this")
    ap.add_argument("--max-segments", type=int, default=1000, help="segments per write call")
    ap.add_argument("--max-gib", type=float, default=9.0, help="refuse to allocate more than this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--path",
        choices=("auto", "handler", "replica"),
        default="auto",
        help="handler: connector.sender.PushHandler.serve (claim, plan, batches, write);\n"
        "replica: the same build_transfer_plan + batches + transport.write sequence without\n"
        "the registry/wire objects (use if PushHandler's API is mid-change); auto: handler\n"
        "if its constructor is one this script knows, else replica",
    )
    ap.add_argument(
        "--cap-kib",
        type=int,
        nargs="*",
        default=[],
        help="also time push-contiguous with every segment cut to this many KiB\n"
        "(the proposed per-segment byte cap; benchmark-side, the connector is unchanged)",
    )
    ap.add_argument(
        "--layers-ceiling-twice",
        action="store_true",
        help="time the per-layer ceiling a second time, right after push-contiguous in the\n"
        "cyclic order: shows how much the same engine call varies with what ran before it",
    )
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

    from connector.plan import RegionLayout
    from connector.transport import MooncakeTransport

    layers, heads, bsz, hd2 = MODELS[args.model]
    block_len = heads * bsz * hd2 * 2
    n = -(-args.tokens // bsz)
    # Blocks per layer on each side; block 0 is vLLM's null block and is never moved.
    ns = n + 1
    m = 2 * n + 1 if "every-other" in args.patterns else n + 1
    src_bytes = layers * n * block_len  # bytes one request moves
    dst_bytes = layers * m * block_len
    need = layers * ns * block_len + dst_bytes
    say(TAG, f"start: {loadavg()}; MemAvailable {mem_available() / 2**30:.1f} GiB")
    say(
        TAG,
        f"model {args.model}: {layers} layers x {heads} kv heads x block {bsz} x "
        f"{hd2 // 2} head_dim bf16 -> {block_len} B per block and layer; "
        f"{args.tokens} tokens = {n} blocks = "
        f"{src_bytes / 2**20:.1f} MiB to move; sender {src_bytes / 2**30:.2f} GiB + "
        f"receiver {dst_bytes / 2**30:.2f} GiB",
    )
    if need > args.max_gib * 2**30:
        raise SystemExit(f"needs {need / 2**30:.1f} GiB > --max-gib {args.max_gib}; lower --tokens")
    if need + 4 * 2**30 > mem_available():
        raise SystemExit("not enough MemAvailable (+4 GiB margin for the others); lower --tokens")
    repeats = args.repeats or (25 if args.model == "tiny" else 5)
    rng = random.Random(args.seed)

    # Sender memory: one allocation, layer r = region r, blocks 0..n-1 all used.
    t0 = time.monotonic()
    src = np.empty((layers * ns, block_len), dtype=np.uint8)
    src[:] = (np.arange(layers * ns, dtype=np.int64) % 251 + 1).astype(np.uint8)[:, None]
    src[:, :8] = np.arange(layers * ns, dtype=np.int64).view(np.uint8).reshape(-1, 8)
    src_base = int(src.ctypes.data)
    say(TAG, f"sender memory filled in {time.monotonic() - t0:.1f}s")
    target = Target(dst_bytes)
    say(TAG, f"receiver process pid {target.proc.pid} up, session {target.session}")
    transport = MooncakeTransport("127.0.0.1", "tcp")
    try:
        transport.register([(src_base, layers * ns * block_len)])
        local = RegionLayout(
            tuple(src_base + r * ns * block_len for r in range(layers)), block_len, block_len, ns
        )
        remote = RegionLayout(
            tuple(target.base + r * m * block_len for r in range(layers)), block_len, block_len, m
        )
        remote_bases = list(remote.base_addrs)
        src_ids = list(range(1, n + 1))
        dst_ids = {
            "contiguous": list(range(1, n + 1)),
            "shuffled": rng.sample(range(1, n + 1), n),
            "every-other": list(range(1, 2 * n, 2)),
        }
        pusher = make_pusher(
            args.path, local, remote, bsz, transport, target.session, args.max_segments
        )
        say(TAG, f"push path: {pusher.describe}")
        info: dict[str, dict] = {}

        def push(pattern: str) -> float:
            dt, segs, nbytes = pusher.push(src_ids, dst_ids[pattern])
            if nbytes != src_bytes:
                raise RuntimeError(f"push {pattern} moved {nbytes} B, expected {src_bytes}")
            info[pattern] = {"segments": segs, "bytes": nbytes}
            return dt

        def ceiling_1seg() -> float:
            t = time.perf_counter()
            transport.write(target.session, [src_base], [target.base], [src_bytes])
            return time.perf_counter() - t

        def ceiling_layers() -> float:
            s = [b + block_len for b in local.base_addrs]
            d = [b + block_len for b in remote_bases]
            t = time.perf_counter()
            transport.write(target.session, s, d, [n * block_len] * layers)
            return time.perf_counter() - t

        variants = {"ceiling-1seg": ceiling_1seg, "ceiling-layers": ceiling_layers}
        for p in args.patterns:
            variants[f"push-{p}"] = lambda p=p: push(p)
            if p == "contiguous" and args.layers_ceiling_twice:
                variants["ceiling-layers-b"] = ceiling_layers
        for kib in args.cap_kib:
            capped = CappedPusher(
                local, remote, transport, target.session, args.max_segments, kib * 1024
            )
            key = f"cap{kib}k"
            dst_ids[key] = dst_ids["contiguous"]

            def run_capped(capped=capped, key=key) -> float:
                dt, segs, nbytes = capped.push(src_ids, dst_ids[key])
                info[key] = {"segments": segs, "bytes": nbytes}
                return dt

            variants[f"push-{key}"] = run_capped

        # Correctness first (sampled blocks, crc32 on both sides), which is also the warm-up.
        def verify(pattern: str) -> None:
            picks = sorted({0, n - 1, *rng.sample(range(n), min(n, 6))})
            spans, want = [], []
            for r in range(layers):
                for i in picks:
                    d = dst_ids[pattern][i]
                    spans.append([(r * m + d) * block_len, block_len])
                    want.append(zlib.crc32(src[r * ns + src_ids[i]]))
            got = target.call(cmd="crc", spans=spans)["crc"]
            if got != want:
                bad = sum(1 for a, b in zip(got, want, strict=True) if a != b)
                raise SystemExit(f"push-{pattern}: {bad}/{len(want)} sampled blocks differ")

        for name, fn in variants.items():
            if name.startswith("push-"):
                target.call(cmd="zero", timeout=120)
            fn()
            if name.startswith("push-"):
                verify(name[5:])
                say(
                    TAG,
                    f"{name}: sampled blocks byte-exact on the receiver; "
                    f"{info[name[5:]]['segments']} segments",
                )
            else:
                fn()
        ceiling_1seg()
        last = src_bytes // block_len - 1
        got = target.call(cmd="crc", spans=[[0, block_len], [last * block_len, block_len]])["crc"]
        if got != [zlib.crc32(src[0]), zlib.crc32(src[last])]:
            raise SystemExit("ceiling-1seg did not land byte-exact")

        times: dict[str, list[float]] = {k: [] for k in variants}
        names = list(variants)
        t_start = time.monotonic()
        for rnd in range(repeats):
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            for name in order:
                times[name].append(variants[name]())
            say(
                TAG,
                f"round {rnd + 1}/{repeats}: "
                + "  ".join(f"{k} {src_bytes / times[k][-1] / 1e9:.2f}" for k in names)
                + f" GB/s; {loadavg()}",
            )
            if time.monotonic() - t_start > args.budget_s:
                say(TAG, f"time budget {args.budget_s:g}s reached after {rnd + 1} rounds")
                break

        # The connector's own CPU cost per push (claim, pair, plan, batches, lists), engine
        # excluded: the same pusher over a write that returns at once.
        class NullTransport:
            def write(self, *_a) -> None:
                return None

        null = make_pusher(
            args.path, local, remote, bsz, NullTransport(), target.session, args.max_segments
        )
        py_us: dict[str, float] = {}
        for p in args.patterns:
            py_us[p] = median([null.push(src_ids, dst_ids[p])[0] for _ in range(30)]) * 1e6
    finally:
        transport.close()
        target.close()

    med = {k: median(v) for k, v in times.items()}
    c1 = med["ceiling-1seg"]
    cl = med["ceiling-layers"]
    # Cost model: t = t_ceiling_1seg + a * extra_segments + b * extra_calls, fitted by least
    # squares on the per-round medians (only meaningful with fragmented patterns present).
    rows_fit = []
    for k in names:
        if k.startswith("push-"):
            segs = info[k[5:]]["segments"]
            calls = -(-segs // args.max_segments)
            rows_fit.append((segs - 1, calls - 1, med[k] - c1))
    fit = None
    if len(rows_fit) >= 2 and any(r[0] > layers for r in rows_fit):
        a_mat = np.array([[r[0]] for r in rows_fit], dtype=float)
        y = np.array([r[2] for r in rows_fit])
        per_seg = float(np.linalg.lstsq(a_mat, y, rcond=None)[0][0])
        fit = per_seg
    rows = []
    for k in names:
        if k == "ceiling-1seg":
            segs, calls = 1, 1
        elif k in ("ceiling-layers", "ceiling-layers-b"):
            segs, calls = layers, 1
        else:
            segs = info[k[5:]]["segments"]
            calls = -(-segs // args.max_segments)
        gbs = [src_bytes / t / 1e9 for t in times[k]]
        rows.append(
            [
                k,
                len(times[k]),
                segs,
                calls,
                src_bytes // segs,
                med[k] * 1e3,
                pct(times[k], 90) * 1e3,
                median(gbs),
                min(gbs),
                c1 / med[k],
                cl / med[k],
                (med[k] - c1) / max(segs - 1, 1) * 1e6 if segs > 1 else float("nan"),
                py_us.get(k[5:], float("nan")),
                median([a / b for a, b in zip(times["ceiling-1seg"], times[k], strict=False)]),
            ]
        )
    say(TAG, f"done: {loadavg()}")
    print()
    print(
        f"model {args.model}, {args.tokens} tokens = {n} blocks x {layers} layers x {block_len} B"
        f" = {src_bytes} B per request; max {args.max_segments} segments per call"
    )
    print(
        table(
            [
                "variant",
                "reps",
                "segments",
                "calls",
                "B/segment",
                "ms (med)",
                "ms (p90)",
                "GB/s (med)",
                "GB/s (min)",
                "vs 1-seg ceiling",
                "vs per-layer ceiling",
                "extra us/segment",
                "python us",
                "paired vs 1-seg",
            ],
            rows,
        )
    )
    print("python us = the push path's own CPU time (same calls, write() returning at once)")
    print("paired vs 1-seg = median over rounds of (1-seg ceiling time / this variant's time) in")
    print("the same round: less sensitive to load drifting between rounds than ratio of medians")
    if fit is not None:
        print(
            f"\nleast-squares extra time per extra segment over the 1-seg ceiling: "
            f"{fit * 1e6:.1f} us"
        )
    if not args.no_plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(8, 4))
            for i, k in enumerate(names):
                gbs = [src_bytes / t / 1e9 for t in times[k]]
                ax.scatter([i + (j - len(gbs) / 2) * 0.01 for j in range(len(gbs))], gbs, s=12)
                ax.hlines(median(gbs), i - 0.3, i + 0.3, color="k")
            ax.set_xticks(range(len(names)), names, rotation=15)
            ax.set_ylabel("GB/s (each dot one round, bar = median)")
            ax.set_title(
                f"push path vs engine ceiling, {args.model}, {args.tokens} tokens, "
                f"{src_bytes / 2**20:.0f} MiB"
            )
            fig.tight_layout()
            path = results_path(f"push_path_{args.model}_{args.tokens}.png")
            fig.savefig(path, dpi=100)
            say(TAG, f"plot: {path}")
        except ImportError:
            say(TAG, "matplotlib not installed: no plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
