"""HTTP client for the two-host lab, run inside the front namespace (`ip netns exec X ...`).

The root namespace never talks to the lab's addresses; this process does, and reports
back as JSON on stdout. Commands (JSON on stdin):
  {"cmd": "wait", "urls": [...], "timeout": s}          until each URL answers 200
  {"cmd": "get", "urls": [...]}                          bodies as text
  {"cmd": "run", "base": url, "requests": [{"name", "path", "body"}], "timeout": s}
  {"cmd": "connect", "targets": [[host, port], ...], "timeout": s}
        TCP connect attempts: "open", "refused", "timeout" or "error: ..." per "host:port"
"""

from __future__ import annotations

import json
import socket
import sys
import time

import httpx


def wait(urls: list[str], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    pending = list(urls)
    with httpx.Client(timeout=3) as c:
        while pending and time.monotonic() < deadline:
            still = []
            for u in pending:
                try:
                    if c.get(u).status_code != 200:
                        still.append(u)
                except httpx.HTTPError:
                    still.append(u)
            pending = still
            if pending:
                time.sleep(0.5)
    return {"not_ready": pending}


def run(base: str, requests: list[dict], timeout: float) -> dict:
    out = {}
    with httpx.Client(base_url=base, timeout=timeout) as c:
        for req in requests:
            t0 = time.monotonic()
            body = req["body"]
            ids: list[int] = []
            status, error = 0, ""
            try:
                if body.get("stream"):
                    with c.stream("POST", req["path"], json=body) as r:
                        status = r.status_code
                        for line in r.iter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                for ch in json.loads(line[6:]).get("choices", []):
                                    ids.extend(ch.get("token_ids") or [])
                else:
                    r = c.post(req["path"], json=body)
                    status = r.status_code
                    if status == 200:
                        ids = r.json()["choices"][0].get("token_ids") or []
                    else:
                        error = r.text
            except httpx.HTTPError as exc:
                error = repr(exc)
            out[req["name"]] = {
                "status": status,
                "ids": ids,
                "error": error,
                "elapsed": time.monotonic() - t0,
            }
    return out


def connect(targets: list[list], timeout: float) -> dict:
    out = {}
    for host, port in targets:
        try:
            with socket.create_connection((host, int(port)), timeout=timeout):
                state = "open"
        except ConnectionRefusedError:
            state = "refused"
        except TimeoutError:
            state = "timeout"
        except OSError as exc:
            state = f"error: {exc}"
        out[f"{host}:{port}"] = state
    return out


def main() -> None:
    cmd = json.loads(sys.stdin.read())
    if cmd["cmd"] == "wait":
        result = wait(cmd["urls"], cmd["timeout"])
    elif cmd["cmd"] == "get":
        with httpx.Client(timeout=10) as c:
            result = {u: c.get(u).text for u in cmd["urls"]}
    elif cmd["cmd"] == "run":
        result = run(cmd["base"], cmd["requests"], cmd.get("timeout", 120))
    elif cmd["cmd"] == "connect":
        result = connect(cmd["targets"], cmd.get("timeout", 1.0))
    else:
        raise SystemExit(f"unknown command {cmd['cmd']}")
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
