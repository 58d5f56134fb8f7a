"""One request's journey: prefill leg on a P, then decode leg on a D, answer relayed back.

Retries happen only while nothing has reached the client: a failed prefill on another
prefiller, a decoder that fails before its first body byte on another decoder (same
``kv_transfer_params``). Once the first byte is sent, a failure ends the stream with an
SSE error event. A client that hangs up cancels the handler task: the upstream
connection in use is closed (vLLM aborts the request), and if a prefill had already
handed its KV over with no decoder started on it, the prefiller is told to free the
blocks at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from proxy.auth import backend_headers
from proxy.errors import ProxyError, error_body, from_upstream
from proxy.metrics import ProxyMetrics
from proxy.pool import Instance, Pool
from proxy.rewrite import (
    check_fidelity,
    decode_body,
    estimate_prompt_tokens,
    prefill_body,
    prefix_key,
    validate_body,
)
from proxy.settings import ProxySettings
from proxy.upstream import IdleTimeout, Upstream, UpstreamFailure, UpstreamStream

logger = logging.getLogger("proxy.request")

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache"}


@dataclass
class Trace:
    """What the request's log line and metrics report."""

    request_id: str
    endpoint: str
    t0: float = field(default_factory=time.perf_counter)
    prefill: str | None = None
    decode: str | None = None
    prefill_s: float | None = None
    decode_first_s: float | None = None
    ttft_s: float | None = None
    upstream_wait_s: float = 0.0
    retries: list[str] = field(default_factory=list)
    fallback: str | None = None
    kv: bool | None = None
    prompt_tokens: int = 0
    outcome: str = "unknown"
    status: int = 200
    phase: str = "start"

    def line(self) -> str:
        def ms(v: float | None) -> float | None:
            return None if v is None else round(v * 1e3, 2)

        return json.dumps(
            {
                "request_id": self.request_id,
                "endpoint": self.endpoint,
                "prefill": self.prefill,
                "decode": self.decode,
                "prompt_tokens_est": self.prompt_tokens,
                "prefill_ms": ms(self.prefill_s),
                "decode_first_byte_ms": ms(self.decode_first_s),
                "ttft_ms": ms(self.ttft_s),
                "total_ms": ms(time.perf_counter() - self.t0),
                "retries": self.retries,
                "fallback": self.fallback,
                "kv_handed_over": self.kv,
                "status": self.status,
                "outcome": self.outcome,
            },
            separators=(",", ":"),
        )


class DisaggRouter:
    def __init__(
        self,
        settings: ProxySettings,
        upstream: Upstream,
        metrics: ProxyMetrics,
        prefill: Pool,
        decode: Pool,
        spawn: Callable[[Any], None],
    ) -> None:
        self._s = settings
        self._up = upstream
        self._m = metrics
        self.prefill = prefill
        self.decode = decode
        self._spawn = spawn
        self.inflight = 0

    async def handle(
        self, request: web.Request, endpoint: str, request_id: str
    ) -> web.StreamResponse:
        tr = Trace(request_id, endpoint)
        self.inflight += 1
        try:
            return await self._serve(request, tr)
        except ProxyError as exc:
            tr.status = exc.status
            if tr.outcome == "unknown":
                tr.outcome = f"error_{exc.status}"
            raise
        except asyncio.CancelledError:
            tr.outcome = "client_gone"
            tr.status = 499
            self._m.client_disconnects.labels(tr.phase).inc()
            raise
        finally:
            self.inflight -= 1
            self._m.requests.labels(endpoint, tr.outcome).inc()
            if logger.isEnabledFor(logging.INFO):
                logger.info("request %s", tr.line())

    async def _serve(self, request: web.Request, tr: Trace) -> web.StreamResponse:
        endpoint = tr.endpoint
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            tr.outcome = "bad_request"
            raise ProxyError(400, f"request body is not valid JSON: {exc}") from exc
        reason = validate_body(body, endpoint)
        bad, alone = check_fidelity(body, endpoint) if reason is None else (reason, None)
        if bad:
            tr.outcome = "bad_request"
            raise ProxyError(400, bad)
        s = self._s
        path = PATHS[endpoint]
        headers = backend_headers(request.headers, tr.request_id, s.backend_auth, s.backend_key)
        tokens = tr.prompt_tokens = estimate_prompt_tokens(body, endpoint, s.chars_per_token)
        key = None
        if "prefix" in (s.prefill_policy, s.decode_policy):
            key = prefix_key(body, endpoint, s.prefix_chars)
        if alone is None and s.min_prefill_tokens and tokens < s.min_prefill_tokens:
            alone = "short_prompt"
        if alone is None and not self.prefill.has_eligible():
            alone = "no_prefiller"
        kv: dict[str, Any] | None = None
        if alone is None:
            tr.phase = "prefill"
            kv = await self._prefill(tr, body, path, headers, tokens, key)
        else:
            tr.fallback = alone
            self._m.fallbacks.labels(alone).inc()
        tr.phase = "between_legs"
        d_data = json.dumps(decode_body(body, kv)).encode()
        stream = bool(body.get("stream"))
        first_byte = False
        try:
            inst, lease, got = await self._decode(tr, path, d_data, headers, tokens, key, stream)
            first_byte = True
        finally:
            if kv is not None and not first_byte:
                # The KV was handed over but no decoder got going with it: free it now.
                self._release_kv(tr, kv)
        if not stream:
            status, content, ctype = got
            lease.release()
            tr.ttft_s = time.perf_counter() - tr.t0
            self._observe_first(tr)
            tr.outcome = "ok"
            return web.Response(
                body=content,
                status=status,
                content_type=ctype or "application/json",
                headers={"x-request-id": tr.request_id},
            )
        return await self._relay(request, tr, got, lease, inst)

    # -- prefill ------------------------------------------------------------------------

    async def _prefill(
        self,
        tr: Trace,
        body: dict[str, Any],
        path: str,
        headers: dict[str, str],
        tokens: int,
        key: bytes | None,
    ) -> dict[str, Any] | None:
        data = json.dumps(prefill_body(body, tr.endpoint)).encode()
        tried: list[Instance] = []
        last: ProxyError | None = None
        last_kind = ""
        for attempt in range(1 + max(0, self._s.prefill_retries)):
            inst = self.prefill.pick(key, tried)
            if inst is None:
                break
            if attempt:
                tr.retries.append(f"prefill:{last_kind}")
            tried.append(inst)
            tr.prefill = inst.url
            lease = self.prefill.lease(inst, tokens)
            t = time.perf_counter()
            try:
                status, content, _ = await self._up.post(
                    "prefill", inst.url, path, data, headers, self._s.timeouts.prefill_s
                )
            except UpstreamFailure as f:
                inst.breaker.failure()
                self._leg_failed(tr, "prefill", inst, f.kind, f.error, tried)
                last, last_kind = f.error, f.kind
                continue
            finally:
                lease.release()
                tr.upstream_wait_s += time.perf_counter() - t
            if status >= 500:
                inst.breaker.failure()
                last, last_kind = from_upstream("prefill", status, content), str(status)
                self._leg_failed(tr, "prefill", inst, str(status), last, tried)
                continue
            inst.breaker.success()
            if status != 200:  # the client's mistake: same answer from any prefiller
                self._m.upstream_errors.labels("prefill", str(status)).inc()
                raise from_upstream("prefill", status, content)
            tr.prefill_s = time.perf_counter() - t
            self._m.prefill_seconds.observe(tr.prefill_s)
            try:
                answer = json.loads(content)
            except ValueError:
                answer = None
            kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            tr.kv = isinstance(kv, dict) and bool(kv)
            if not tr.kv:
                self._m.missing_kv_params.inc()
                logger.warning(
                    "request %s: prefill %s sent no kv_transfer_params; decoder computes the "
                    "prompt",
                    tr.request_id,
                    inst.url,
                )
                return None
            return kv
        if last is None:
            raise ProxyError(503, "no prefill instance available", "no_instance")
        raise last

    # -- decode -------------------------------------------------------------------------

    async def _decode(
        self,
        tr: Trace,
        path: str,
        data: bytes,
        headers: dict[str, str],
        tokens: int,
        key: bytes | None,
        stream: bool,
    ):
        tried: list[Instance] = []
        last: ProxyError | None = None
        last_kind = ""
        for attempt in range(1 + max(0, self._s.decode_retries)):
            inst = self.decode.pick(key, tried, last_resort=True)
            if inst is None:
                break
            if attempt:
                tr.retries.append(f"decode:{last_kind}")
            tried.append(inst)
            tr.decode = inst.url
            tr.phase = "decode_first_byte"
            lease = self.decode.lease(inst, tokens)
            t = time.perf_counter()
            ok = False
            try:
                if stream:
                    got: Any = await self._up.open_stream("decode", inst.url, path, data, headers)
                    status, content = got.status, got.first
                else:
                    got = await self._up.post(
                        "decode", inst.url, path, data, headers, self._s.timeouts.decode_s
                    )
                    status, content = got[0], got[1]
                ok = status == 200
            except UpstreamFailure as f:
                inst.breaker.failure()
                self._leg_failed(tr, "decode", inst, f.kind, f.error, tried)
                last, last_kind = f.error, f.kind
                continue
            finally:
                tr.upstream_wait_s += time.perf_counter() - t
                if not ok:
                    lease.release()
            if status >= 500:
                inst.breaker.failure()
                last, last_kind = from_upstream("decode", status, content), str(status)
                self._leg_failed(tr, "decode", inst, str(status), last, tried)
                continue
            inst.breaker.success()
            if status != 200:
                self._m.upstream_errors.labels("decode", str(status)).inc()
                raise from_upstream("decode", status, content)
            tr.decode_first_s = time.perf_counter() - t
            self._m.decode_first_byte_seconds.observe(tr.decode_first_s)
            return inst, lease, got
        if last is None:
            raise ProxyError(503, "no decode instance available", "no_instance")
        raise last

    def _leg_failed(
        self, tr: Trace, leg: str, inst: Instance, kind: str, err: ProxyError, tried: list
    ) -> None:
        self._m.upstream_errors.labels(leg, kind).inc()
        limit = self._s.prefill_retries if leg == "prefill" else self._s.decode_retries
        done = sum(1 for r in tr.retries if r.startswith(leg))
        pool = self.prefill if leg == "prefill" else self.decode
        will_retry = done < limit and bool(pool.eligible(tried))
        if will_retry:
            self._m.retries.labels(leg, kind).inc()
        logger.warning(
            "request %s: %s leg on %s failed (%s): %s%s",
            tr.request_id,
            leg,
            inst.url,
            kind,
            err,
            "; retrying on another instance" if will_retry else "",
        )

    def _observe_first(self, tr: Trace) -> None:
        assert tr.ttft_s is not None
        self._m.ttft_seconds.observe(tr.ttft_s)
        self._m.added_seconds.observe(max(0.0, tr.ttft_s - tr.upstream_wait_s))

    # -- relay --------------------------------------------------------------------------

    async def _relay(
        self, request: web.Request, tr: Trace, up: UpstreamStream, lease, inst: Instance
    ) -> web.StreamResponse:
        """Pass the decoder's SSE bytes through as they come; always close the upstream."""
        tr.phase = "decode_stream"
        resp = web.StreamResponse(headers={**_SSE_HEADERS, "x-request-id": tr.request_id})
        observe_gap = self._m.inter_chunk_seconds.observe
        clock = time.perf_counter
        try:
            await resp.prepare(request)
            await resp.write(up.first)
            last = clock()
            tr.ttft_s = last - tr.t0
            self._observe_first(tr)
            try:
                while chunk := await up.read():
                    now = clock()
                    observe_gap(now - last)
                    last = now
                    await resp.write(chunk)
                tr.outcome = "ok"
            except IdleTimeout:
                tr.outcome = "stream_timeout"
                self._m.upstream_errors.labels("decode", "idle_timeout").inc()
                msg = f"decode instance {inst.url} went silent for {self._s.timeouts.idle_s:g}s"
                await resp.write(_sse_error(504, msg))
            except ConnectionResetError:
                raise
            except Exception as exc:  # the decoder broke the stream
                if isinstance(exc, OSError) and request.transport is None:
                    raise
                tr.outcome = "stream_error"
                self._m.upstream_errors.labels("decode", "stream_broken").inc()
                await resp.write(_sse_error(502, f"decode instance {inst.url} broke the stream"))
            await resp.write_eof()
        except ConnectionResetError:
            tr.outcome = "client_gone"
            tr.status = 499
            self._m.client_disconnects.labels("decode_stream").inc()
        finally:
            up.close()
            lease.release()
        return resp

    # -- between legs -------------------------------------------------------------------

    def _release_kv(self, tr: Trace, kv: dict[str, Any]) -> None:
        timeout = self._s.release_timeout_s

        async def release() -> None:
            from connector.release import release_remote

            err = await release_remote(kv, timeout_s=timeout)
            self._m.kv_releases.labels("ok" if err is None else "failed").inc()
            if err is None:
                logger.info("request %s: released held KV on the prefiller", tr.request_id)
            else:
                logger.warning("request %s: KV release failed: %s", tr.request_id, err)

        self._spawn(release())


def _sse_error(status: int, message: str) -> bytes:
    """An error after the stream began can only travel as an SSE event (as vLLM does)."""
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\ndata: [DONE]\n\n"
