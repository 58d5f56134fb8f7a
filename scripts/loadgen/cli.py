"""Command line: ``pd-loadgen run ...`` drives a target, ``pd-loadgen compare ...`` compares.

    pd-loadgen run --base-url http://127.0.0.1:8000 --concurrency 1,4 --num-requests 100
    pd-loadgen compare results/a.json results/b.json --labels colocated,1p1d

See docs/load-testing.md for every option, the metric definitions and examples.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from scripts.loadgen import workloads as wl
from scripts.loadgen.arrival import CONSTANT, POISSON, parse_levels
from scripts.loadgen.client import Timeouts
from scripts.loadgen.compare import full_table, headline_table
from scripts.loadgen.report import (
    build_result,
    host_info,
    load_average,
    read_result,
    summary_table,
    write_result,
)
from scripts.loadgen.runner import RunConfig, TargetFailed, run_levels
from scripts.loadgen.stats import Slo

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER = ROOT / "models" / "tiny-llama"

# Per-workload defaults for (input, output) lengths when not given.
_DEFAULT_LENS = {
    wl.FIXED: ("384", "48"),
    wl.RANDOM: ("256-512", "32-64"),
    wl.SHARED_PREFIX: ("64-128", "32-64"),
    wl.MULTI_TURN: ("64-128", "32-64"),
    wl.JSONL: ("1", "32-64"),
}

EXIT_OK, EXIT_USAGE, EXIT_TARGET = 0, 2, 3


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="pd-loadgen",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="send load to one OpenAI-compatible target")
    t = r.add_argument_group("target")
    t.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (no /v1)")
    t.add_argument("--endpoint", choices=(wl.COMPLETIONS, wl.CHAT), default=wl.COMPLETIONS)
    t.add_argument("--model", default="", help="model name; default: first of /v1/models")
    t.add_argument(
        "--tokenizer",
        type=Path,
        default=DEFAULT_TOKENIZER,
        help="local tokenizer dir of the served model (default: %(default)s)",
    )
    t.add_argument("--no-stream", action="store_true", help="ask for whole JSON answers")
    t.add_argument("--header", action="append", default=[], metavar="K:V", help="extra header")
    w = r.add_argument_group("workload")
    w.add_argument("--workload", choices=wl.KINDS, default=wl.RANDOM)
    w.add_argument("--input-len", help="prompt tokens: N or MIN-MAX (per turn / after prefix)")
    w.add_argument("--output-len", help="max output tokens: N or MIN-MAX")
    w.add_argument("--prefix-len", type=int, default=384, help="shared-prefix: prefix tokens")
    w.add_argument("--groups", type=int, default=4, help="shared-prefix: number of prefixes")
    w.add_argument("--turns", type=int, default=3, help="multi-turn: turns per conversation")
    w.add_argument("--dataset", type=Path, help="jsonl: one {prompt|messages[,max_tokens]}/line")
    w.add_argument("--temperature", type=float, default=0.0, help="<0 leaves it unset")
    w.add_argument("--ignore-eos", action="store_true", help="vLLM: always emit max tokens")
    w.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    w.add_argument("--seed", type=int, default=0)
    a = r.add_argument_group("arrival and bounds")
    a.add_argument("--rate", help="requests/s (Poisson by default); '1,2,4' sweeps; 'inf'")
    a.add_argument("--concurrency", help="closed loop with N in flight; '1,4,8' sweeps")
    a.add_argument("--arrival", choices=(POISSON, CONSTANT), default=POISSON)
    a.add_argument("--max-concurrency", type=int, help="with --rate: cap on requests in flight")
    a.add_argument("--num-requests", type=int, default=100, help="measured requests per level")
    a.add_argument("--duration", type=float, default=300.0, help="max seconds per level")
    a.add_argument("--warmup", type=int, default=4, help="unmeasured requests before the run")
    a.add_argument("--timeout", type=float, default=300.0, help="max seconds per request")
    a.add_argument("--idle-timeout", type=float, default=60.0, help="max silence in a stream")
    a.add_argument("--connect-timeout", type=float, default=5.0)
    a.add_argument(
        "--max-consecutive-failures",
        type=int,
        default=10,
        help="stop the run when this many requests fail in a row",
    )
    s = r.add_argument_group("SLOs (goodput)")
    _slo_args(s)
    o = r.add_argument_group("output")
    o.add_argument("--out-dir", type=Path, default=None, help="default: results/<time>")
    o.add_argument("--label", default=None, help="name of this target in tables and plots")
    o.add_argument("--note", default="", help="free text stored in the result and printed")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--markdown", action="store_true", help="print tables as Markdown")
    o.add_argument("--keep-text", action="store_true", help="store generated text per request")

    c = sub.add_parser("compare", help="compare two or more result files side by side")
    c.add_argument("files", nargs="+", type=Path)
    c.add_argument("--labels", help="comma-separated names, default: each file's label")
    c.add_argument("--out-dir", type=Path, default=None, help="plots go here (default: cwd)")
    c.add_argument("--full", action="store_true", help="every metric, not just the headline")
    c.add_argument("--markdown", action="store_true")
    c.add_argument("--no-plots", action="store_true")
    _slo_args(c)
    return ap


def _slo_args(g: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    g.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT must be <= this")
    g.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT must be <= this")
    g.add_argument("--slo-e2el-ms", type=float, help="goodput: E2EL must be <= this")


def _slo(ns: argparse.Namespace) -> Slo:
    return Slo(ns.slo_ttft_ms, ns.slo_tpot_ms, ns.slo_e2el_ms)


def _spec(ns: argparse.Namespace) -> wl.WorkloadSpec:
    din, dout = _DEFAULT_LENS[ns.workload]
    spec = wl.WorkloadSpec(
        kind=ns.workload,
        endpoint=ns.endpoint,
        input_len=wl.parse_range(ns.input_len or din),
        output_len=wl.parse_range(ns.output_len or dout),
        groups=ns.groups,
        prefix_len=ns.prefix_len,
        turns=ns.turns,
        dataset=ns.dataset,
    )
    if spec.kind == wl.FIXED and (
        spec.input_len[0] != spec.input_len[1] or spec.output_len[0] != spec.output_len[1]
    ):
        raise ValueError("the fixed workload takes single lengths; use --workload random")
    if spec.groups < 1 or spec.turns < 1 or spec.prefix_len < 1:
        raise ValueError("--groups, --turns and --prefix-len must be >= 1")
    return spec


def cmd_run(ns: argparse.Namespace, log: Callable[[str], None]) -> int:
    started = time.monotonic()
    levels = parse_levels(
        ns.rate,
        ns.concurrency if (ns.concurrency or ns.rate) else "4",
        ns.arrival,
        ns.max_concurrency,
    )
    if ns.num_requests < 1 or ns.duration <= 0:
        raise ValueError("--num-requests must be >= 1 and --duration > 0")
    spec = _spec(ns)
    extra = json.loads(ns.extra_body)
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    headers = dict(h.split(":", 1) for h in ns.header)
    if not ns.tokenizer.is_dir():
        raise ValueError(f"tokenizer dir {ns.tokenizer} not found; pass --tokenizer")
    log(f"loading tokenizer {ns.tokenizer}")
    tok = wl.load_tokenizer(ns.tokenizer)
    t0 = time.monotonic()
    per_level = []
    inexact = 0
    for i in range(len(levels)):
        # A fresh seed per level: a level must not hit the prefix cache of the previous one.
        sessions, bad = wl.build_sessions(spec, ns.num_requests, tok, ns.seed + 1000 * (i + 1))
        per_level.append(sessions)
        inexact += bad
    warm, _ = wl.build_sessions(spec, max(ns.warmup, 1), tok, ns.seed + 999_983)
    log(
        f"built {len(levels)} x {ns.num_requests} {spec.kind} prompts in "
        f"{time.monotonic() - t0:.1f}s"
        + (f" ({inexact} not token-exact: their real counts are recorded)" if inexact else "")
    )

    def count_tokens(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    cfg = RunConfig(
        base_url=ns.base_url,
        endpoint=ns.endpoint,
        sampling=wl.Sampling(
            model=ns.model,
            stream=not ns.no_stream,
            temperature=None if ns.temperature < 0 else ns.temperature,
            ignore_eos=ns.ignore_eos,
            extra=extra,
        ),
        num_requests=ns.num_requests,
        duration_s=ns.duration,
        warmup=ns.warmup,
        timeouts=Timeouts(ns.connect_timeout, ns.idle_timeout, ns.timeout),
        max_consecutive_failures=ns.max_consecutive_failures,
        seed=ns.seed,
        headers=headers,
        progress=not ns.no_progress,
    )
    label = ns.label or ns.base_url.split("//")[-1].replace(":", "_").replace("/", "_")
    out_dir = ns.out_dir or Path("results") / time.strftime("%Y%m%d-%H%M%S")
    meta = {
        "label": label,
        "target": ns.base_url,
        "endpoint": ns.endpoint,
        "stream": not ns.no_stream,
        "workload": spec.to_json(),
        "levels": [lv.to_json() for lv in levels],
        "num_requests": ns.num_requests,
        "duration_s": ns.duration,
        "warmup": ns.warmup,
        "seed": ns.seed,
        "temperature": cfg.sampling.temperature,
        "ignore_eos": ns.ignore_eos,
        "slo": _slo(ns).to_json(),
        "tokenizer": str(ns.tokenizer),
        "note": ns.note,
        "host": host_info(),
        "command": "pd-loadgen " + shlex.join(sys.argv[1:]),
    }
    code = EXIT_OK
    try:
        phases = asyncio.run(
            run_levels(cfg, levels, lambda i: per_level[i], warm, count_tokens, log)
        )
    except TargetFailed as e:
        log(f"ERROR: target failed: {e}")
        phases = e.phases
        code = EXIT_TARGET
        if not phases:
            return code
    meta["model"] = cfg.sampling.model
    meta["host"]["loadavg_at_end"] = load_average()
    res = build_result(meta, phases, _slo(ns))
    path = write_result(res, out_dir / f"{label}.json", keep_text=ns.keep_text)
    print(f"\n== {label}: {ns.base_url} {wl.ENDPOINT_PATHS[ns.endpoint]}, {spec.kind} ==")
    if ns.note:
        print(f"note: {ns.note}")
    print(summary_table(res, markdown=ns.markdown))
    log(
        f"results: {path} (load average at start {meta['host']['loadavg_at_start']}, "
        f"at end {meta['host']['loadavg_at_end']})"
    )
    if not ns.no_plots:
        from scripts.loadgen.plots import plot_result

        for p in plot_result(res, out_dir, label):
            log(f"plot: {p}")
    log(f"done in {time.monotonic() - started:.1f}s")
    return code


def cmd_compare(ns: argparse.Namespace, log: Callable[[str], None]) -> int:
    slo = _slo(ns)
    results = [read_result(f, slo if slo.active() else None) for f in ns.files]
    if ns.labels:
        labels = [x.strip() for x in ns.labels.split(",")]
        if len(labels) != len(results):
            raise ValueError(f"--labels has {len(labels)} names for {len(results)} files")
        for res, lab in zip(results, labels, strict=False):
            res.meta["label"] = lab
    print(headline_table(results, markdown=ns.markdown))
    if ns.full:
        print()
        print(full_table(results, markdown=ns.markdown))
    for res in results:
        if res.meta.get("note"):
            print(f"note ({res.label}): {res.meta['note']}")
    if not ns.no_plots:
        from scripts.loadgen.plots import plot_compare

        for p in plot_compare(results, ns.out_dir or Path(".")):
            log(f"plot: {p}")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("--") and argv[0] not in ("--help",):
        argv = ["run", *argv]  # `pd-loadgen --base-url ...` means run

    def log(msg: str) -> None:
        print(f"[loadgen {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    ns = build_parser().parse_args(argv)
    try:
        if ns.command == "run":
            return cmd_run(ns, log)
        return cmd_compare(ns, log)
    except (ValueError, OSError) as e:
        log(f"ERROR: {e}")
        return EXIT_USAGE
