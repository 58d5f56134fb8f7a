"""A/B on the CPU lab: the same workload against one colocated vLLM and against 1P1D.

    .venv/bin/python -m scripts.ab_test                      # default workload, a few minutes
    .venv/bin/python -m scripts.ab_test --concurrency 1,4 --num-requests 20 --input-len 64-128

(a) one colocated vLLM instance, (b) prefill vLLM + decode vLLM + our proxy, each started
with scripts/pdlab.py, driven by pd-loadgen with identical prompts (same seed), then
compared: a table of medians/p99 and ratios on stdout and in ab-summary.md, result JSONs and
PNG plots in the output directory. The stacks run one after the other, so neither competes
with the other's idle processes.

Read the numbers with the CPU placement in mind: on this 2-core lab the colocated instance
is pinned to ONE core (core 0, --colocated-cpus to change) while 1P1D has TWO (prefill on
core 0, decode on core 1); the proxy and the load generator float over both cores in both
runs. This measures the P/D machinery end to end; it is not a per-GPU efficiency result.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from scripts.loadgen import cli as loadgen
from scripts.loadgen.compare import headline_table
from scripts.loadgen.report import read_result
from scripts.pdlab import (
    DEFAULT_MODEL,
    Lab,
    ProcessDied,
    free_port,
    pd_stack,
    vllm_child,
)

A, B = "colocated", "1p1d"
VLLM_BENCH_TIMEOUT_S = 300.0


def say(msg: str) -> None:
    print(f"[ab {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.ab_test",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out-dir", type=Path, default=None, help="default: results/ab-<time>")
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    ap.add_argument("--workload", default="random", help="any pd-loadgen workload")
    ap.add_argument("--input-len", default="256-512")
    ap.add_argument("--output-len", default="32-64")
    ap.add_argument("--concurrency", default="1,4,8", help="levels (closed loop)")
    ap.add_argument("--rate", default=None, help="levels in req/s instead of --concurrency")
    ap.add_argument("--num-requests", type=int, default=100, help="per level and target")
    ap.add_argument("--duration", type=float, default=120.0, help="max seconds per level")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-ttft-ms", type=float, default=None)
    ap.add_argument("--slo-tpot-ms", type=float, default=None)
    ap.add_argument("--colocated-cpus", default="0", help="OMP binding of the colocated one")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--start-timeout", type=float, default=240.0)
    ap.add_argument(
        "--parallel-start",
        action="store_true",
        help="start both stacks at once (faster; the idle 1P1D stack sits there during A)",
    )
    ap.add_argument(
        "--vllm-bench",
        action="store_true",
        help="also run vLLM's own benchmark client against both targets (cross-check)",
    )
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--loadgen-arg",
        action="append",
        default=[],
        help="extra pd-loadgen run argument, e.g. --loadgen-arg=--no-stream (repeatable)",
    )
    return ap


def core_note(cpus: str) -> str:
    n = len(expand_cpus(cpus))
    return (
        f"CPU placement: colocated vLLM pinned to {n} core(s) ({cpus}); 1P1D has 2 "
        "(prefill core 0, decode core 1); proxy and load generator float over both cores. "
        "1P1D therefore has more CPU here; compare the shapes, not per-core efficiency."
    )


def expand_cpus(spec: str) -> set[int]:
    """'0' -> {0}; '0-1' -> {0, 1}; '0,2-3' -> {0, 2, 3}."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def loadgen_argv(ns: argparse.Namespace, url: str, label: str, out: Path, note: str) -> list[str]:
    argv = [
        "run",
        "--base-url",
        url,
        "--label",
        label,
        "--out-dir",
        str(out),
        "--tokenizer",
        str(ns.model_dir),
        "--endpoint",
        ns.endpoint,
        "--workload",
        ns.workload,
        "--input-len",
        ns.input_len,
        "--output-len",
        ns.output_len,
        "--num-requests",
        str(ns.num_requests),
        "--duration",
        str(ns.duration),
        "--warmup",
        str(ns.warmup),
        "--seed",
        str(ns.seed),
        "--ignore-eos",
        "--note",
        note,
    ]
    argv += ["--rate", ns.rate] if ns.rate else ["--concurrency", ns.concurrency]
    if ns.slo_ttft_ms is not None:
        argv += ["--slo-ttft-ms", str(ns.slo_ttft_ms)]
    if ns.slo_tpot_ms is not None:
        argv += ["--slo-tpot-ms", str(ns.slo_tpot_ms)]
    if ns.no_plots:
        argv.append("--no-plots")
    if ns.no_progress:
        argv.append("--no-progress")
    return argv + list(ns.loadgen_arg)


def vllm_bench(ns: argparse.Namespace, url: str, label: str, out: Path) -> dict[str, object]:
    """vLLM's client against ``url``: a similar random workload at the highest level."""
    lo, hi = (int(x) for x in _range(ns.input_len))
    olo, ohi = (int(x) for x in _range(ns.output_len))
    mid, omid = (lo + hi) // 2, (olo + ohi) // 2
    conc = max(int(float(x)) for x in (ns.concurrency or "1").split(","))
    argv = [
        sys.executable,
        "-m",
        "scripts.loadgen.vllm_bench",
        "--backend",
        "openai-chat" if ns.endpoint == "chat" else "openai",
        "--endpoint",
        "/v1/chat/completions" if ns.endpoint == "chat" else "/v1/completions",
        "--base-url",
        url,
        "--model",
        "tiny-llama",
        "--tokenizer",
        str(ns.model_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(mid),
        "--random-output-len",
        str(omid),
        "--random-range-ratio",
        f"{min((hi - lo) / max(2 * mid, 1), 0.99):.3f}",
        "--num-prompts",
        str(min(ns.num_requests, 50)),
        "--max-concurrency",
        str(conc),
        "--ignore-eos",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--temperature",
        "0",
        "--disable-tqdm",
        "--seed",
        str(ns.seed),
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        f"vllm-bench-{label}.json",
    ]
    say(f"vLLM bench against {label}: {shlex.join(argv[1:])}")
    log = out / f"vllm-bench-{label}.log"
    t0 = time.monotonic()
    with log.open("wb") as f:
        proc = subprocess.run(
            argv,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=VLLM_BENCH_TIMEOUT_S,
            check=False,
        )
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"vLLM bench against {label} failed ({proc.returncode}):\n{tail}")
    data = json.loads((out / f"vllm-bench-{label}.json").read_text())
    data["_wall_s"] = time.monotonic() - t0
    data["_concurrency"] = conc
    return data


def _range(text: str) -> tuple[str, str]:
    parts = text.replace(":", "-").split("-")
    return parts[0], parts[-1]


def vllm_bench_table(ours: dict[str, object], theirs: dict[str, dict[str, object]]) -> str:
    """vLLM's medians next to ours at the same concurrency (a definitions cross-check)."""

    def f(x: object, digits: int) -> str:
        return f"{x:.{digits}f}" if isinstance(x, (int, float)) else "-"

    rows = ["| target | client | TTFT p50 | TPOT p50 | ITL p50 | E2EL p50 | ok/failed |"]
    rows.append("|---|---|---:|---:|---:|---:|---:|")
    for label, data in theirs.items():
        s = ours.get(label)
        if isinstance(s, dict):
            rows.append(
                f"| {label} | pd-loadgen | {f(s['ttft_ms']['p50'], 1)} "
                f"| {f(s['tpot_ms']['p50'], 2)} | {f(s['itl_ms']['p50'], 2)} "
                f"| {f(s['e2el_ms']['p50'], 1)} | {s['completed']}/{s['failed']} |"
            )
        rows.append(
            f"| {label} | vllm bench | {f(data.get('median_ttft_ms'), 1)} "
            f"| {f(data.get('median_tpot_ms'), 2)} | {f(data.get('median_itl_ms'), 2)} "
            f"| {f(data.get('median_e2el_ms'), 1)} "
            f"| {data.get('completed')}/{data.get('failed', 0)} |"
        )
    return "\n".join(rows)


def colocated_stack(ns: argparse.Namespace, log_dir: Path) -> tuple[Lab, str]:
    port = free_port()
    child = vllm_child(
        "colocated",
        "colocated",
        port,
        log_dir,
        block_size=ns.block_size,
        model_dir=ns.model_dir,
        env={"CPU_CORE": ns.colocated_cpus},
    )
    return Lab([child]), child.url


def pd_lab(ns: argparse.Namespace, log_dir: Path) -> tuple[Lab, str, dict[str, str]]:
    stack = pd_stack(log_dir, block_size=ns.block_size, model_dir=ns.model_dir)
    urls = {"proxy": stack.proxy.url, "prefill": stack.prefill.url, "decode": stack.decode.url}
    return stack.lab, stack.proxy.url, urls


def main(
    argv: list[str] | None = None,
    on_pd_stack: Callable[[dict[str, str]], None] | None = None,
) -> int:
    """Run the A/B; ``on_pd_stack`` (for callers such as tests) runs extra checks against
    the live 1P1D stack after its measured run, before it is stopped."""
    ns = build_parser().parse_args(argv)
    try:
        return run(ns, argv, on_pd_stack)
    except (ProcessDied, TimeoutError, RuntimeError, subprocess.TimeoutExpired) as e:
        # Every child is already stopped (the labs are context managers); say why, plainly.
        say(f"ERROR: {e}")
        return 1


def run(
    ns: argparse.Namespace,
    argv: list[str] | None,
    on_pd_stack: Callable[[dict[str, str]], None] | None,
) -> int:
    t_start = time.monotonic()
    out = (ns.out_dir or Path("results") / time.strftime("ab-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="pd-ab-", dir=out))
    note = core_note(ns.colocated_cpus)
    say(note)
    say(f"results in {out}, server logs in {log_dir}")
    summaries: dict[str, object] = {}
    bench: dict[str, dict[str, object]] = {}

    def measure(label: str, url: str) -> None:
        code = loadgen.main(loadgen_argv(ns, url, label, out, note))
        if code != 0:
            raise RuntimeError(f"load generator against {label} ended with code {code}")
        res = read_result(out / f"{label}.json")
        summaries[label] = res.phases[-1].summary
        if ns.vllm_bench:
            bench[label] = vllm_bench(ns, url, label, out)

    lab_a, url_a = colocated_stack(ns, log_dir)
    lab_b, url_b, urls_b = pd_lab(ns, log_dir)
    if ns.parallel_start:
        # One start-up wait for both stacks; the colocated one is stopped after its run.
        both = Lab([*lab_a.children, *lab_b.children])
        with both:
            t0 = time.monotonic()
            say("starting colocated and 1p1d together")
            both.start_all(timeout_s=ns.start_timeout, progress=say)
            say(f"both stacks ready in {time.monotonic() - t0:.1f}s")
            measure(A, url_a)
            lab_a.stop_all()
            say(f"{A} stopped")
            measure(B, url_b)
            if on_pd_stack is not None:
                on_pd_stack(urls_b)
            say(f"stopping {B}")
    else:
        for label, lab, url in ((A, lab_a, url_a), (B, lab_b, url_b)):
            t0 = time.monotonic()
            with lab:
                say(f"starting {label}")
                lab.start_all(timeout_s=ns.start_timeout, progress=say)
                say(f"{label} ready in {time.monotonic() - t0:.1f}s")
                measure(label, url)
                if label == B and on_pd_stack is not None:
                    on_pd_stack(urls_b)
                say(f"stopping {label}")
            say(f"{label} stopped")

    results = [read_result(out / f"{A}.json"), read_result(out / f"{B}.json")]
    table = headline_table(results)
    md = headline_table(results, markdown=True)
    print(f"\n== A/B: {A} vs {B} ==\n{note}\n{table}")
    plots: list[Path] = []
    if not ns.no_plots:
        from scripts.loadgen.plots import plot_compare

        plots = plot_compare(results, out, stem="ab")
    wall = time.monotonic() - t_start
    command = "python -m scripts.ab_test " + shlex.join(sys.argv[1:] if argv is None else argv)
    parts = [
        f"# A/B: {A} vs {B}",
        "",
        f"Command: `{command}`  ",
        f"Wall time: {wall:.0f} s (both stacks started, measured, stopped).  ",
        f"Workload: {ns.workload} on /v1/{ns.endpoint}, input {ns.input_len} tokens, output "
        f"{ns.output_len} tokens (ignore_eos), {ns.num_requests} measured requests per level, "
        f"levels {('rate ' + ns.rate) if ns.rate else ('concurrency ' + ns.concurrency)}, "
        f"greedy, streaming.  ",
        f"{note}  ",
        "Load average (1 min) at start / end of each run: "
        + ", ".join(
            f"{r.label} {(r.meta['host'].get('loadavg_at_start') or ['?'])[0]} / "
            f"{(r.meta['host'].get('loadavg_at_end') or ['?'])[0]}"
            for r in results
        )
        + " (2 cores; above ~2 something else was competing).",
        "",
        md,
    ]
    if bench:
        parts += ["", "vLLM's own client (`vllm bench serve`) at the highest level, next to ours:"]
        parts += ["", vllm_bench_table(summaries, bench)]
        print("\n" + vllm_bench_table(summaries, bench))
    (out / "ab-summary.md").write_text("\n".join(parts) + "\n")
    for p in plots:
        say(f"plot: {p}")
    say(f"summary: {out / 'ab-summary.md'}")
    say(f"wall time {wall:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
