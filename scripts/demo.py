"""The 1P1D demo: prefill vLLM + decode vLLM + our proxy on this machine, two real requests.

    .venv/bin/python -m scripts.demo [--keep] [--port 8000]

Starts the stack (prefill pinned to core 0, decode to core 1), waits until every process
is ready, sends one completion and one chat request through the proxy, shows that the
decoder received the prompt's KV instead of computing it, and stops everything.
"""

from __future__ import annotations

import argparse
import re
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

from scripts.pdlab import (
    free_port,
    pd_stack,
    prompt_tokens_by_source,
)


def say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--port", type=int, default=8000, help="proxy port")
    ap.add_argument("--prefill-port", type=int, default=8100)
    ap.add_argument("--decode-port", type=int, default=8200)
    ap.add_argument("--side-channel-port", type=int, default=17100)
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the stack up until Ctrl-C")
    args = ap.parse_args()
    for name in ("port", "prefill_port", "decode_port", "side_channel_port"):
        port = getattr(args, name)
        try:
            with socket.create_server(("127.0.0.1", port)):
                pass
        except OSError:
            new = free_port()
            say(f"port {port} is busy; using {new} for --{name.replace('_', '-')}")
            setattr(args, name, new)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pd-demo-"))
    stack = pd_stack(
        log_dir,
        ports=(args.prefill_port, args.decode_port, args.port),
        side_channel_port=args.side_channel_port,
    )
    lab, d_url = stack.lab, stack.decode.url
    t0 = time.monotonic()
    with lab:
        say(f"starting 1P1D on CPU; logs in {log_dir}")
        lab.start_all(progress=say)
        say(f"stack ready in {time.monotonic() - t0:.1f}s")
        base = f"http://127.0.0.1:{args.port}"
        with httpx.Client(base_url=base, timeout=120) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            prompt = (
                "Disaggregated prefill and decode split the prompt pass from token "
                "generation, so the prefill node computes the KV cache once and the "
                "decode node receives it over the network."
            )
            r = client.post(
                "/v1/completions",
                json={"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0},
            )
            r.raise_for_status()
            out = r.json()
            say(
                f"completion ({out['usage']['prompt_tokens']} prompt tokens, "
                f"x-request-id {r.headers.get('x-request-id')}): {out['choices'][0]['text']!r}"
            )
            r = client.post(
                "/v1/chat/completions",
                json={
                    "model": model,
                    "max_tokens": 16,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": "What does a KV connector do?"}],
                },
            )
            r.raise_for_status()
            out = r.json()
            say(
                f"chat ({out['usage']['prompt_tokens']} prompt tokens): "
                f"{out['choices'][0]['message']['content']!r}"
            )
        sources = prompt_tokens_by_source(httpx.get(d_url + "/metrics", timeout=10).text)
        say(f"decoder prompt tokens by source: {sources}")
        pushes = re.findall(r"transfer \S+: pushed .*", (log_dir / "prefill.log").read_text())
        for line in pushes:
            say(f"prefill connector: {line}")
        ok = sources.get("external_kv_transfer", 0) > 0 and sources.get("local_compute", 0) == 0
        say(
            "KV crossed over: the decoder computed no prompt token itself"
            if ok
            else "WARNING: the decoder computed prompt tokens itself"
        )
        if args.keep:
            say(f"proxy at {base} (Ctrl-C to stop)")
            try:
                while all(c.alive() for c in lab.children):
                    time.sleep(1)
                say("a process exited; stopping")
            except KeyboardInterrupt:
                pass
        say("stopping")
    say("stopped cleanly")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
