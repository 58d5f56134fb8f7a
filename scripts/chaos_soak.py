"""Chaos soak (issue 11): 2P2D + proxy under bounded mixed load through a seeded fault
schedule, then invariants, a per-fault table and a timeline plot.

    python -m scripts.chaos_soak --duration 1800 --seed 11      # the 30-minute soak
    python -m scripts.chaos_soak --duration 180 --seed 3        # the smoke (e2e test)

Exit code 0 only if every gating invariant passes. Everything lands in ``--out-dir``:
events.jsonl (every request, fault, signal, RSS sample), plan.json, report.md, timeline.png,
and the instances' and proxy's logs. See docs/chaos.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from scripts import netns
from scripts.chaos import schedule as S
from scripts.chaos.cases import Case, answer_ids, answer_text, make_cases
from scripts.chaos.faults import FaultRunner
from scripts.chaos.invariants import evaluate
from scripts.chaos.lab import SoakLab, build
from scripts.chaos.load import Client, now_fn, run_load
from scripts.chaos.monitor import Monitor
from scripts.chaos.promtext import log_signals, proxy_up_times
from scripts.chaos.report import fault_table, invariant_table, outcome_counts, plot
from scripts.pdlab import DEFAULT_MODEL, ROOT

MODEL = "tiny-llama"
# The smoke (tests/e2e/test_chaos_smoke.py): one fault of each family in 3 minutes.
SMOKE_KINDS = [
    S.KILL_DECODE,
    S.STOP_PREFILL,
    S.BLOCK_SIDE_CHANNEL,
    S.HANGUP_MID_STREAM,
    S.POISON_400,
    S.ADMIN_REMOVE_ADD,
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration", type=float, default=1800, help="load seconds (1800)")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out-dir", type=Path)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second (2)")
    ap.add_argument("--deadline", type=float, default=60.0, help="per-request deadline, s")
    ap.add_argument("--cases", type=int, default=24, help="size of the greedy case pool")
    ap.add_argument("--faults", help="comma-separated kinds (default: all): " + ",".join(S.KINDS))
    ap.add_argument("--hold", type=float, default=12.0, help="freeze / partition / drain, s")
    ap.add_argument("--settle", type=float, default=5.0, help="window after each fault, s")
    ap.add_argument("--gap", type=float, nargs=2, default=(8.0, 20.0), help="quiet gap, s")
    ap.add_argument("--warmup", type=float, default=15.0, help="fault-free start, s")
    ap.add_argument("--expiry-s", type=float, default=10.0, help="connector expiry_s")
    ap.add_argument("--pull-timeout-s", type=float, default=7.0, help="connector pull timeout")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--no-netns", action="store_true", help="loopback only (no partitions)")
    ap.add_argument("--no-lean", action="store_true", help="vLLM's default multiprocessing")
    ap.add_argument("--rss-margin", type=float, default=0.10, help="allowed RSS growth fraction")
    ap.add_argument("--rss-margin-mb", type=float, default=64.0, help="plus this many MiB")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="3-minute variant: --duration 180, six fault kinds, 10 s holds, short gaps",
    )
    ap.add_argument("--strict-goals", action="store_true", help="timing goals gate the exit code")
    args = ap.parse_args(argv)
    if args.smoke:
        args.duration, args.warmup, args.hold, args.gap = 180.0, 10.0, 10.0, (3.0, 5.0)
        args.faults = args.faults or ",".join(SMOKE_KINDS)
    return args


def proxy_args(args: argparse.Namespace) -> list[str]:
    """Timeouts shorter than the freezes, so a frozen instance is a failure, not a wait."""
    return [
        "--wait-backends", str(args.start_timeout),
        "--health-interval", "1",
        "--connect-timeout", "2",
        "--prefill-timeout", "8",
        "--decode-timeout", "20",
        "--idle-timeout", "6",
        "--breaker-open-time", "5",
    ]  # fmt: skip


class Journal:
    """events.jsonl plus the in-memory lists the invariants read."""

    def __init__(self, path: Path) -> None:
        self.f = path.open("w")
        self.requests: list[dict[str, Any]] = []
        self.faults: list[dict[str, Any]] = []
        self.wall0 = 0.0  # wall-clock time of the load's start

    def __call__(self, rec: dict[str, Any]) -> None:
        if rec["type"] == "request":
            self.requests.append(rec)
        elif rec["type"] == "fault":
            self.faults.append(rec)
        self.f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self.f.flush()


async def references(base: str, cases: list[Case], timeout_s: float) -> dict[str, Any]:
    """Colocated greedy answers: each case sent to a decoder alone (no kv params)."""
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as s:
        for c in cases:
            async with (
                asyncio.timeout(timeout_s),
                s.post(base + c.path, json=c.request(MODEL, False)) as r,
            ):
                body = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"reference for {c.name} failed: {r.status} {body}")
                out[c.name] = (answer_ids(body), answer_text(body))
    return out


def proxy_routes(log: Path) -> dict[str, dict[str, Any]]:
    """request id -> the proxy's per-request log line (which instances served it)."""
    out = {}
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        i = line.find(" proxy.request: ")
        j = line.find("{", i) if i >= 0 else -1
        if j < 0:
            continue
        try:
            d = json.loads(line[j:])
        except ValueError:
            continue
        out[d.get("request_id", "")] = d
    return out


async def soak(args: argparse.Namespace, lab: SoakLab, out: Path, plan: list[S.PlannedFault]):  # type: ignore[no-untyped-def]
    vocab = int(json.loads((DEFAULT_MODEL / "config.json").read_text())["vocab_size"])
    cases = make_cases(args.seed, vocab, n=args.cases)
    t_ref = time.monotonic()
    refs = await references(lab.by_role("decode")[0].url, cases, 120)
    print(
        f"[chaos] {len(refs)} colocated reference answers in {time.monotonic() - t_ref:.1f}s",
        flush=True,
    )
    journal = Journal(out / "events.jsonl")
    clock = now_fn()
    journal.wall0 = time.time() - clock()
    journal({"type": "clock", "wall0": journal.wall0})
    stop = asyncio.Event()
    monitor = Monitor(lab, clock, journal)
    async with Client(lab.proxy_url, MODEL, clock, journal, deadline_s=args.deadline) as client:
        runner = FaultRunner(
            lab, client, monitor, clock, vocab=vocab, settle_s=args.settle,
            log=lambda m: print(f"[chaos {clock():7.1f}s] {m}", flush=True),
        )  # fmt: skip
        load_done = asyncio.Event()

        async def load() -> None:
            try:
                n = await run_load(
                    client, cases, refs, seed=args.seed, duration_s=args.duration,
                    rate=args.rate, concurrency=args.concurrency, stop=stop,
                )  # fmt: skip
                print(f"[chaos {clock():7.1f}s] load done: {n} requests sent", flush=True)
            finally:
                load_done.set()

        async def faults() -> None:
            free_at = 0.0
            for f in plan:
                start = max(f.planned_start_s, free_at)
                if start + f.estimate_s > args.duration - 5:
                    journal({"type": "skipped", **f.to_dict(), "why": "no time left"})
                    print(f"[chaos {clock():7.1f}s] fault {f.index} {f.kind}: skipped (time)")
                    continue
                while clock() < start and not load_done.is_set():
                    await asyncio.sleep(min(0.2, start - clock()))
                if load_done.is_set():
                    break
                rec = await runner.apply(f)
                journal(rec)
                free_at = rec["settle_end"] + 1.0
                while clock() < rec["settle_end"]:
                    await asyncio.sleep(0.2)
                runner.current = "-"

        async def progress() -> None:
            while not load_done.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(load_done.wait(), 15)
                c = Counter(r["outcome"] for r in journal.requests)
                wrong = sum(1 for r in journal.requests if r.get("match") is False)
                print(
                    f"[chaos {clock():7.1f}s] requests {dict(c)} wrong={wrong} "
                    f"faults done={len(journal.faults)}/{len(plan)} current={runner.current}",
                    flush=True,
                )

        mon = asyncio.create_task(monitor.run(stop))
        await asyncio.gather(load(), faults(), progress())
        # Quiescence: nothing in flight; held transfers end by use, release or expiry.
        wait_s = args.expiry_s + 3
        print(
            f"[chaos {clock():7.1f}s] quiescing {wait_s:g}s (expiry {args.expiry_s:g}s)", flush=True
        )
        await asyncio.sleep(wait_s)
        final = await monitor.final_levels(timeout_s=args.expiry_s + 30)
        stop.set()
        await mon
        journal({"type": "final", "t": round(clock(), 3), "levels": final})
        journal.f.close()
        return journal, monitor, final


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cmd = "python -m scripts.chaos_soak " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    if "--seed" not in cmd:
        cmd += f" --seed {args.seed}"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out_dir or ROOT / "results" / f"chaos-seed{args.seed}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    print(f"[chaos] command: {cmd}", flush=True)
    print(f"[chaos] results in {out}", flush=True)
    why = "--no-netns" if args.no_netns else netns.available()
    kinds = args.faults.split(",") if args.faults else list(S.KINDS)
    notes = []
    if why:
        notes.append(f"no partition faults: two-host lab unavailable ({why}); loopback lab")
        kinds = [k for k in kinds if k not in S.PARTITIONS]
        print(f"[chaos] {notes[-1]}", flush=True)
    plan = S.plan(
        args.seed, args.duration, kinds, warmup_s=args.warmup, settle_s=args.settle,
        gap_s=tuple(args.gap), hold_s=args.hold,
    )  # fmt: skip
    (out / "plan.json").write_text(json.dumps([f.to_dict() for f in plan], indent=1))
    print(f"[chaos] plan: {len(plan)} faults: {', '.join(f.kind for f in plan)}", flush=True)

    def on_term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    if why is None:
        netns.TwoHostNet.reap_stale()
    lab = build(
        out / "logs", use_netns=why is None, expiry_s=args.expiry_s,
        pull_timeout_s=args.pull_timeout_s, proxy_args=proxy_args(args), lean=not args.no_lean,
    )  # fmt: skip
    t0 = time.monotonic()
    try:
        for ch in lab.children():
            ch.start()
            print(f"[chaos] started {ch.name} pid {ch.pid} {ch.url}", flush=True)
        lab.wait_ready(args.start_timeout, progress=lambda m: print(f"[chaos] {m}", flush=True))
        print(f"[chaos] lab ready in {time.monotonic() - t0:.1f}s", flush=True)
        journal, monitor, final = asyncio.run(soak(args, lab, out, plan))
    finally:
        lab.stop()
    routes = proxy_routes(out / "logs" / "proxy.log")
    ups: list[tuple[float, str]] = []
    with contextlib.suppress(OSError):
        text = (out / "logs" / "proxy.log").read_text(errors="replace")
        monitor.signals.extend(log_signals(text, journal.wall0))
        monitor.signals.sort(key=lambda s: s["t"])
        ups = proxy_up_times(text, journal.wall0)
    for r in journal.requests:
        line = routes.get(r["id"])
        if line:
            r["prefill_url"], r["decode_url"] = line.get("prefill"), line.get("decode")
            r["proxy_outcome"] = line.get("outcome")
    with (out / "requests.jsonl").open("w") as f:
        for r in journal.requests:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    checks, timings = evaluate(
        journal.requests, journal.faults, final, monitor.rss, monitor.signals,
        rss_margin_frac=args.rss_margin, rss_margin_mb=args.rss_margin_mb, ups=ups,
    )  # fmt: skip
    if args.strict_goals:
        for c in checks:
            c.gating = True
    counts = outcome_counts(journal.requests)
    title = f"chaos soak seed {args.seed}, {args.duration:g}s, {len(journal.requests)} requests"
    plot(out / "timeline.png", journal.requests, journal.faults, title)
    report = "\n\n".join(
        [
            f"# {title}",
            f"Command: `{cmd}`",
            f"Lab: {'two-host namespaces' if why is None else 'loopback'}; "
            + "; ".join([*notes, f"fault kinds: {', '.join(kinds)}"]),
            f"Requests by outcome: {counts}",
            "## Invariants\n\n" + invariant_table(checks),
            "## Faults\n\n" + fault_table(timings),
            f"Plot: {out / 'timeline.png'}",
        ]
    )
    (out / "report.md").write_text(report + "\n")
    print(report, flush=True)
    failed = [c for c in checks if c.gating and not c.passed]
    print(
        f"[chaos] {'FAIL' if failed else 'PASS'}: {len(failed)} gating invariants failed; "
        f"command: {cmd}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
