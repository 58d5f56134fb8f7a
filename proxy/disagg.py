"""One request's journey: prefill leg on P, then decode leg on D, answer relayed back."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.responses import Response, StreamingResponse

from proxy.errors import ProxyError, error_body
from proxy.metrics import ProxyMetrics
from proxy.pool import RoundRobin
from proxy.rewrite import decode_body, prefill_body
from proxy.settings import ProxySettings
from proxy.upstream import Upstream

logger = logging.getLogger("proxy.request")

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def upstream_headers(client_headers: dict[str, str], request_id: str) -> dict[str, str]:
    """What the backends see: JSON, the shared request id, and the client's credentials."""
    out = {"content-type": "application/json", "x-request-id": request_id}
    auth = client_headers.get("authorization")
    if auth:
        out["authorization"] = auth
    return out


class DisaggRouter:
    def __init__(self, settings: ProxySettings, upstream: Upstream, metrics: ProxyMetrics) -> None:
        self._settings = settings
        self._up = upstream
        self._m = metrics
        self.prefill = RoundRobin(settings.prefill)
        self.decode = RoundRobin(settings.decode)

    async def serve(
        self, endpoint: str, body: dict[str, Any], client_headers: dict[str, str], request_id: str
    ) -> Response:
        path = PATHS[endpoint]
        headers = upstream_headers(client_headers, request_id)
        p_url, d_url = self.prefill.next(), self.decode.next()
        t0 = time.perf_counter()
        try:
            p_answer = await self._up.post_json(
                "prefill",
                p_url,
                path,
                prefill_body(body, endpoint),
                headers,
                self._settings.timeouts.prefill_s,
            )
        except ProxyError as exc:
            self._m.upstream_errors.labels("prefill", str(exc.status)).inc()
            self._log(request_id, endpoint, p_url, d_url, t0, None, f"prefill error {exc.status}")
            raise
        prefill_s = time.perf_counter() - t0
        self._m.prefill_seconds.observe(prefill_s)
        kv = p_answer.get("kv_transfer_params")
        if not isinstance(kv, dict) or not kv:
            kv = None
            self._m.missing_kv_params.inc()
            logger.warning(
                "request %s: prefill %s sent no kv_transfer_params; decoder computes the prompt",
                request_id,
                p_url,
            )
        d_body = decode_body(body, kv)
        resp_headers = {"x-request-id": request_id}
        if body.get("stream"):
            try:
                stream = await self._up.open_stream("decode", d_url, path, d_body, headers)
            except ProxyError as exc:
                self._m.upstream_errors.labels("decode", str(exc.status)).inc()
                self._log(
                    request_id, endpoint, p_url, d_url, t0, prefill_s, f"decode error {exc.status}"
                )
                raise
            self._m.decode_first_byte_seconds.observe(time.perf_counter() - t0 - prefill_s)
            return StreamingResponse(
                self._relay(stream, request_id, endpoint, p_url, d_url, t0, prefill_s),
                media_type="text/event-stream",
                headers={**resp_headers, "cache-control": "no-cache"},
            )
        try:
            d_resp = await self._up.post(
                "decode", d_url, path, d_body, headers, self._settings.timeouts.decode_s
            )
        except ProxyError as exc:
            self._m.upstream_errors.labels("decode", str(exc.status)).inc()
            self._log(
                request_id, endpoint, p_url, d_url, t0, prefill_s, f"decode error {exc.status}"
            )
            raise
        self._m.decode_first_byte_seconds.observe(time.perf_counter() - t0 - prefill_s)
        self._m.requests.labels(endpoint, "ok").inc()
        self._log(request_id, endpoint, p_url, d_url, t0, prefill_s, "ok", kv is not None)
        return Response(d_resp.content, media_type="application/json", headers=resp_headers)

    async def _relay(
        self,
        resp: httpx.Response,
        request_id: str,
        endpoint: str,
        p_url: str,
        d_url: str,
        t0: float,
        prefill_s: float,
    ) -> AsyncIterator[bytes]:
        """Pass the decoder's SSE bytes through as they come; always close the upstream."""
        outcome = "ok"
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.TimeoutException:
            outcome = "stream_timeout"
            msg = f"decode instance {d_url} went silent for {self._settings.timeouts.idle_s:g}s"
            yield _sse_error(504, msg)
        except httpx.HTTPError as exc:
            outcome = "stream_error"
            yield _sse_error(502, f"decode instance {d_url} broke the stream: {exc!r}")
        except BaseException:
            outcome = "client_gone"
            raise
        finally:
            await resp.aclose()
            self._m.requests.labels(endpoint, outcome).inc()
            self._log(request_id, endpoint, p_url, d_url, t0, prefill_s, outcome)

    @staticmethod
    def _log(
        request_id: str,
        endpoint: str,
        p_url: str,
        d_url: str,
        t0: float,
        prefill_s: float | None,
        outcome: str,
        kv: bool | None = None,
    ) -> None:
        logger.info(
            "request %s %s P=%s D=%s prefill_ms=%s total_ms=%.1f kv_handed_over=%s outcome=%s",
            request_id,
            endpoint,
            p_url,
            d_url,
            "-" if prefill_s is None else f"{prefill_s * 1e3:.1f}",
            (time.perf_counter() - t0) * 1e3,
            "-" if kv is None else kv,
            outcome,
        )


def _sse_error(status: int, message: str) -> bytes:
    """An error after the stream began can only travel as an SSE event (as vLLM does)."""
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\ndata: [DONE]\n\n"
