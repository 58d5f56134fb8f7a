"""HTTP side of one request: send it, time its SSE chunks (or whole JSON), classify failures.

Every wait is bounded: connect, the gap between two chunks (idle), and the whole request.
The caller's task cancellation (phase deadline) is honoured at any point.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from scripts.loadgen.records import ERROR, OK, RequestRecord
from scripts.loadgen.sse import SseDecoder, StreamTimer, choice_text


@dataclass(frozen=True)
class Timeouts:
    """Seconds; total bounds a whole request, idle the silence between two chunks."""

    connect_s: float = 5.0
    idle_s: float = 60.0
    total_s: float = 300.0

    def httpx(self) -> httpx.Timeout:
        return httpx.Timeout(
            connect=self.connect_s, read=self.idle_s, write=self.idle_s, pool=self.total_s
        )


def make_client(max_connections: int, timeouts: Timeouts) -> httpx.AsyncClient:
    """One pooled client per run; trust_env off so no proxy variable reroutes loopback."""
    return httpx.AsyncClient(
        timeout=timeouts.httpx(),
        limits=httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        ),
        trust_env=False,
    )


async def send(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    rec: RequestRecord,
    phase_t0: float,
    timeouts: Timeouts,
    count_tokens: Callable[[str], int] | None = None,
    headers: dict[str, str] | None = None,
) -> RequestRecord:
    """Fill ``rec`` with what happened; never raises except on cancellation."""
    rec.streamed = bool(body.get("stream"))
    start = time.perf_counter()
    rec.start_s = start - phase_t0
    try:
        await asyncio.wait_for(
            _exchange(client, url, body, rec, start, headers or {}), timeouts.total_s
        )
    except TimeoutError:
        _fail(rec, "timeout", f"no complete answer within {timeouts.total_s:g}s")
    except httpx.ConnectTimeout as e:
        _fail(rec, "connect_timeout", _msg(e))
    except httpx.ConnectError as e:
        _fail(rec, "connect_error", _msg(e))
    except httpx.ReadTimeout as e:
        _fail(rec, "idle_timeout", f"no data for {timeouts.idle_s:g}s ({_msg(e)})")
    except httpx.TimeoutException as e:
        _fail(rec, "timeout", _msg(e))
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
        _fail(rec, "connection_lost", _msg(e))
    except httpx.HTTPError as e:
        _fail(rec, "http_error", _msg(e))
    if rec.ok and rec.output_tokens is None and count_tokens is not None:
        # No usage from the server: count the text, as vLLM's client does in that case.
        rec.output_tokens = count_tokens(rec.text)
        rec.output_tokens_from = "tokenizer"
    return rec


async def _exchange(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    rec: RequestRecord,
    start: float,
    headers: dict[str, str],
) -> None:
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        rec.http_status = resp.status_code
        if resp.status_code != 200:
            raw = await resp.aread()
            _fail(rec, f"http_{resp.status_code}", _error_text(raw))
            return
        if not rec.streamed:
            raw = await resp.aread()
            rec.e2el_s = time.perf_counter() - start
            _from_json(rec, raw)
            return
        timer = StreamTimer(start)
        sse = SseDecoder()
        async for chunk in resp.aiter_bytes():
            now = time.perf_counter()
            for data in sse.feed(chunk):
                timer.on_data(now, data)
        for data in sse.flush():
            timer.on_data(time.perf_counter(), data)
    _from_stream(rec, timer)


def _from_stream(rec: RequestRecord, timer: StreamTimer) -> None:
    rec.ttft_s = timer.ttft
    rec.e2el_s = timer.e2el
    rec.itl_s = timer.itl
    rec.text = timer.text
    _usage(rec, timer.usage)
    if timer.error is not None:
        _fail(rec, "stream_error", timer.error)
    elif timer.first_token_at is None:
        _fail(rec, "no_tokens", "stream ended without any chunk carrying choices")
    elif not timer.done:
        # Stricter than vLLM's client (which counts it as a success): a stream cut before
        # [DONE] is a broken answer, and a P/D proxy must not hide one.
        _fail(rec, "truncated_stream", f"stream ended after {timer.chunks} chunks, no [DONE]")
    else:
        rec.status = OK


def _from_json(rec: RequestRecord, raw: bytes) -> None:
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        _fail(rec, "bad_response", f"not JSON: {raw[:200]!r}")
        return
    if not isinstance(data, dict) or not data.get("choices"):
        _fail(rec, "bad_response", _error_text(raw))
        return
    rec.text = choice_text(data["choices"][0])
    _usage(rec, data.get("usage"))
    rec.status = OK


def _usage(rec: RequestRecord, usage: dict[str, Any] | None) -> None:
    if not usage:
        return
    if usage.get("prompt_tokens") is not None:
        rec.prompt_tokens = int(usage["prompt_tokens"])
    if usage.get("completion_tokens") is not None:
        rec.output_tokens = int(usage["completion_tokens"])
        rec.output_tokens_from = "usage"


def _fail(rec: RequestRecord, kind: str, msg: str) -> None:
    rec.status = ERROR
    rec.error_kind = kind
    rec.error = msg[:500]


def _msg(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _error_text(raw: bytes) -> str:
    try:
        data = json.loads(raw)
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            return str(data["error"].get("message", data["error"]))
        return json.dumps(data)[:500]
    except (json.JSONDecodeError, UnicodeDecodeError):
        return raw[:500].decode(errors="replace")
