"""CPU of a prefill instance while it holds one request's KV for a decoder that never comes.

    python -m scripts.bench.idle_cpu [--idle-wait-ms 5] [--seconds 4]

vLLM keeps stepping an engine while a transfer is outstanding, even with nothing to run.
This starts one prefill vLLM (pdlab), measures the CPU of its whole process group idle,
then while holding one request (a one-token prefill with do_remote_decode and no decoder),
then after the connector's expiry freed it. Compare --idle-wait-ms 0 (vLLM's own pacing)
with the default.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from scripts.pdlab import Lab, free_port, kv_config, vllm_child


def group_cpu_percent(pgid: int, seconds: float) -> float:
    def ticks() -> int:
        out = subprocess.run(
            ["ps", "-o", "times=", "-g", str(pgid)], capture_output=True, text=True
        )
        return sum(int(x) for x in out.stdout.split())

    t0 = ticks()
    time.sleep(seconds)
    return (ticks() - t0) / seconds * 100


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--idle-wait-ms", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()
    log = Path(tempfile.mkdtemp(prefix="idle-cpu-"))
    expiry = args.seconds * 2 + 6
    kv = kv_config("prefill", free_port(), expiry_s=expiry, idle_wait_ms=args.idle_wait_ms)
    port = free_port()
    child = vllm_child("prefill", "prefill", port, log, core=0, kv=kv)
    with Lab([child]) as lab:
        lab.start_all(timeout_s=300)
        time.sleep(2)
        print(
            f"idle, nothing held:          {group_cpu_percent(child.pid, args.seconds):5.0f}% CPU"
        )
        r = httpx.post(
            child.url + "/v1/completions",
            json={
                "model": "tiny-llama",
                "prompt": list(range(5, 200)),
                "max_tokens": 1,
                "min_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True},
            },
            timeout=60,
        )
        assert r.json()["kv_transfer_params"], "prefill did not hand over its KV"
        print(
            f"holding 1 request for a D:   {group_cpu_percent(child.pid, args.seconds):5.0f}% CPU"
        )
        time.sleep(max(0.0, expiry - args.seconds + 2))
        print(
            f"after expiry freed it:       {group_cpu_percent(child.pid, args.seconds):5.0f}% CPU"
        )


if __name__ == "__main__":
    main()
