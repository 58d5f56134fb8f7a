"""One request's journey: prefill leg on a P, then decode leg on a D, answer relayed back.

Retries happen only while nothing has reached the client: a failed prefill on another
prefiller, a decoder that fails before its first body byte on another decoder (same
``kv_transfer_params``). Once the first byte is sent, a failure ends the stream with an
SSE error event. A client that hangs up cancels the handler task: the upstream
connection in use is closed (vLLM aborts the request), and if a prefill had already
handed its KV over with no decoder started on it, the prefiller is told to free the
blocks at once, on every TP rank. A client that stops reading is dropped after
``limits.write_timeout_s`` the same way.

The transfer secret the prefiller returns goes to the decoder and the release only: it is
never logged, and scrubbed from a decoder's error answer before that reaches a log or
the client.
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
from proxy.bodies import BodyParser, BodyReader
from proxy.clientguard import WriteDeadline
from proxy.errors import ProxyError, error_body, from_upstream
from proxy.logsafe import escape, get_logger, redact
from proxy.metrics import ProxyMetrics
from proxy.pool import Instance, Pool
from proxy.rewrite import PlanOptions, with_kv
from proxy.settings import ProxySettings
from proxy.upstream import IdleTimeout, Overloaded, Upstream, UpstreamFailure, UpstreamStream

logger = get_logger("proxy.request")

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
    counted: bool = False  # in DisaggRouter.inflight

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
        bodies: BodyReader,
        parser: BodyParser,
    ) -> None:
        self._s = settings
        self._up = upstream
        self._m = metrics
        self.prefill = prefill
        self.decode = decode
        self._spawn = spawn
        self._bodies = bodies
        self._parser = parser
        keyed = "prefix" in (settings.prefill_policy, settings.decode_policy)
        self._plan_opts = PlanOptions(
            settings.chars_per_token,
            settings.prefix_chars if keyed else 0,
            settings.min_prefill_tokens,
        )
        # Requests being served (body received): what a graceful shutdown waits for.
        self.inflight = 0

    async def handle(
        self, request: web.Request, endpoint: str, request_id: str
    ) -> web.StreamResponse:
        tr = Trace(request_id, endpoint)
        try:
            return await self._serve(request, tr)
        except ProxyError as exc:
            tr.status = exc.status
            if tr.outcome == "unknown":
                tr.outcome = f"error_{exc.status}"
            raise
        except asyncio.CancelledError:
            if tr.outcome != "client_write_timeout":
                tr.outcome = "client_gone"
                self._m.client_disconnects.labels(tr.phase).inc()
            tr.status = 499
            raise
        finally:
            if tr.counted:
                self.inflight -= 1
            self._m.requests.labels(endpoint, tr.outcome).inc()
            if logger.isEnabledFor(logging.INFO):
                logger.info("request %s", tr.line())

    async def _serve(self, request: web.Request, tr: Trace) -> web.StreamResponse:
        endpoint = tr.endpoint
        tr.phase = "body"
        raw = await self._bodies.read(request)
        # Counted from here: a client still sending its body does not hold up a shutdown.
        self.inflight += 1
        tr.counted = True
        plan = await self._parser.plan(raw, endpoint, self._plan_opts)
        del raw  # the plan holds the legs' bodies; the client's bytes can go
        if plan.error is not None:
            tr.outcome = "bad_request"
            raise ProxyError(400, plan.error)
        s = self._s
        path = PATHS[endpoint]
        headers = backend_headers(request.headers, tr.request_id, s.backend_auth, s.backend_key)
        tokens = tr.prompt_tokens = plan.tokens
        key = plan.key
        alone = plan.alone
        # The decoder is settled before any prefill, so a request no decoder can take
        # costs no prefill and holds no blocks.
        if not self.decode.has_members():
            tr.outcome = "no_decoder"
            raise ProxyError(503, "no decode instance available", "no_instance")
        if alone is None and not self.decode.has_eligible():
            # Panic routing on decode (every decoder marked down): a transfer would only
            # be wasted if the pick fails, and a decoder that just came back computes the
            # prompt itself.
            alone = "no_healthy_decoder"
        if alone is None and not self.prefill.has_eligible():
            alone = "no_prefiller"
        kv: dict[str, Any] | None = None
        if alone is None:
            assert plan.prefill is not None
            tr.phase = "prefill"
            kv = await self._prefill(tr, plan.prefill, path, headers, tokens, key)
        else:
            tr.fallback = alone
            self._m.fallbacks.labels(alone).inc()
        tr.phase = "between_legs"
        d_data = with_kv(plan.decode, kv)
        stream = plan.stream
        secret = kv.get("transfer_secret") if kv else None
        first_byte = False
        try:
            inst, lease, got = await self._decode(
                tr, path, d_data, headers, tokens, key, stream, secret
            )
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
            resp = web.Response(
                body=content,
                status=status,
                content_type=ctype or "application/json",
                headers={"x-request-id": tr.request_id},
            )
            wd = self._write_deadline(request, tr)
            try:
                await wd.prepare(resp, request)
                await wd.write_eof(resp)
                tr.outcome = "ok"
            except ConnectionResetError:
                tr.outcome, tr.status = "client_gone", 499
                self._m.client_disconnects.labels("response").inc()
            finally:
                wd.close()
            return resp
        return await self._relay(request, tr, got, lease, inst)

    def _write_deadline(self, request: web.Request, tr: Trace) -> WriteDeadline:
        def expired() -> None:
            tr.outcome = "client_write_timeout"
            self._m.limit_hits.labels("write_timeout").inc()
            logger.warning(
                "request %s: client did not read its response for %gs; dropped",
                tr.request_id,
                self._s.limits.write_timeout_s,
            )

        return WriteDeadline(request, self._s.limits.write_timeout_s, expired)

    # -- prefill ------------------------------------------------------------------------

    async def _prefill(
        self,
        tr: Trace,
        data: bytes,
        path: str,
        headers: dict[str, str],
        tokens: int,
        key: bytes | None,
    ) -> dict[str, Any] | None:
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
            except Overloaded as o:
                self._overloaded(inst)
                last, last_kind = o.error, "overloaded"
                continue
            except UpstreamFailure as f:
                self.prefill.failure(inst, "gateway")
                self._leg_failed(tr, "prefill", inst, f.kind, f.error, tried)
                last, last_kind = f.error, f.kind
                continue
            finally:
                lease.release()
                tr.upstream_wait_s += time.perf_counter() - t
            if status >= 500:
                self.prefill.failure(inst, "answer")
                last, last_kind = from_upstream("prefill", status, content), str(status)
                self._leg_failed(tr, "prefill", inst, str(status), last, tried)
                continue
            self.prefill.success(inst)
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
        secret: str | None = None,
    ):
        tried: list[Instance] = []
        last: ProxyError | None = None
        last_kind = ""
        for attempt in range(1 + max(0, self._s.decode_retries)):
            inst = self.decode.pick(key, tried, panic=True)
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
            except Overloaded as o:
                self._overloaded(inst)
                last, last_kind = o.error, "overloaded"
                continue
            except UpstreamFailure as f:
                self.decode.failure(inst, "gateway")
                self._leg_failed(tr, "decode", inst, f.kind, f.error, tried)
                last, last_kind = f.error, f.kind
                continue
            finally:
                tr.upstream_wait_s += time.perf_counter() - t
                if not ok:
                    lease.release()
            if status != 200 and secret:  # a decoder echoing its request: scrub the secret
                content = redact(content, secret)
            if status >= 500:
                self.decode.failure(inst, "answer")
                last, last_kind = from_upstream("decode", status, content), str(status)
                self._leg_failed(tr, "decode", inst, str(status), last, tried)
                continue
            self.decode.success(inst)
            if status != 200:
                self._m.upstream_errors.labels("decode", str(status)).inc()
                raise from_upstream("decode", status, content)
            tr.decode_first_s = time.perf_counter() - t
            self._m.decode_first_byte_seconds.observe(tr.decode_first_s)
            return inst, lease, got
        if last is None:
            raise ProxyError(503, "no decode instance available", "no_instance")
        raise last

    def _overloaded(self, inst: Instance) -> None:
        """The proxy's own slots to ``inst`` stayed full: not the instance's failure (a
        half-open trial goes back with the lease)."""
        self._m.limit_hits.labels("upstream_pool").inc()

    def _leg_failed(
        self, tr: Trace, leg: str, inst: Instance, kind: str, err: ProxyError, tried: list
    ) -> None:
        self._m.upstream_errors.labels(leg, kind).inc()
        limit = self._s.prefill_retries if leg == "prefill" else self._s.decode_retries
        done = sum(1 for r in tr.retries if r.startswith(leg))
        pool = self.prefill if leg == "prefill" else self.decode
        will_retry = done < limit and pool.could_pick(tried, panic=leg == "decode")
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
        wd = self._write_deadline(request, tr)
        write = wd.write
        try:
            await wd.prepare(resp, request)
            await write(resp, up.first)
            last = clock()
            tr.ttft_s = last - tr.t0
            self._observe_first(tr)
            try:
                while chunk := await up.read():
                    now = clock()
                    observe_gap(now - last)
                    last = now
                    await write(resp, chunk)
                tr.outcome = "ok"
            except IdleTimeout:
                tr.outcome = "stream_timeout"
                self._m.upstream_errors.labels("decode", "idle_timeout").inc()
                msg = f"decode instance {inst.url} went silent for {self._s.timeouts.idle_s:g}s"
                await write(resp, _sse_error(504, msg))
            except ConnectionResetError:
                raise
            except Exception as exc:  # the decoder broke the stream
                if isinstance(exc, OSError) and request.transport is None:
                    raise
                tr.outcome = "stream_error"
                self._m.upstream_errors.labels("decode", "stream_broken").inc()
                await write(resp, _sse_error(502, f"decode instance {inst.url} broke the stream"))
            await wd.write_eof(resp)
        except ConnectionResetError:
            if tr.outcome != "client_write_timeout":
                tr.outcome = "client_gone"
                self._m.client_disconnects.labels("decode_stream").inc()
            tr.status = 499
        finally:
            wd.close()
            up.close()
            lease.release()
        return resp

    # -- between legs -------------------------------------------------------------------

    def _release_kv(self, tr: Trace, kv: dict[str, Any]) -> None:
        """Free the prefiller's held blocks on every TP rank (``remote_tp_size`` in the
        params; each rank holds its share). Only error texts are logged, secret scrubbed."""
        timeout = self._s.release_timeout_s
        secret = kv.get("transfer_secret")

        async def release() -> None:
            from connector.release import release_all_ranks

            errors = await release_all_ranks(kv, timeout_s=timeout)
            self._m.kv_releases.labels("failed" if errors else "ok").inc()
            if not errors:
                logger.info("request %s: released held KV on the prefiller", tr.request_id)
            else:
                text = "; ".join(errors)
                if isinstance(secret, str) and secret:
                    text = text.replace(secret, "<redacted>")
                logger.warning("request %s: KV release failed: %s", tr.request_id, escape(text))

        self._spawn(release())


def _sse_error(status: int, message: str) -> bytes:
    """An error after the stream began can only travel as an SSE event (as vLLM does)."""
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\ndata: [DONE]\n\n"
