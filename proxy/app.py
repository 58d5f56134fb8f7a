"""The proxy process: HTTP surface (aiohttp.web), pools, health checks, admin API, shutdown.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (live), ``GET /ready`` (a healthy P and D, not shutting down),
``GET /metrics``, and with an admin key ``GET|POST|DELETE /admin/instances``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Coroutine
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.auth import backend_headers, bearer, client_allowed, key_ok
from proxy.bodies import BodyParser, BodyReader
from proxy.clientguard import ConnectionGuard, GuardedSite
from proxy.disagg import DisaggRouter
from proxy.errors import ProxyError, error_body
from proxy.logsafe import ClientErrorFilter, get_logger, one_line_exception, request_id
from proxy.metrics import ProxyMetrics
from proxy.pool import Instance, Pool
from proxy.settings import InstanceSpec, ProxySettings
from proxy.upstream import Overloaded, Upstream, describe

logger = get_logger("proxy.app")
# aiohttp's server logs (malformed requests, connection errors) go through our filters.
http_logger = get_logger("proxy.http", ClientErrorFilter((HttpProcessingError,)))

# The request's id, decided once per request (web.RequestKey from aiohttp 3.12 on).
_RID: Any = web.RequestKey("pd_request_id", str) if hasattr(web, "RequestKey") else "pd_rid"
ADMIN_MAX_BODY = 64 * 1024


def _request_id(request: web.Request) -> str:
    """The request's id, decided once: the client's X-Request-Id if it is safe (short,
    ``[A-Za-z0-9._:-]``), else a generated one (the response carries it either way)."""
    rid = request.get(_RID)
    if rid is None:
        rid, accepted = request_id(request.headers.get("x-request-id"))
        request[_RID] = rid
        if not accepted and "x-request-id" in request.headers:
            logger.debug("replaced an unsafe X-Request-Id with %s", rid)
    return rid


def _json_error(status: int, message: str, rid: str | None = None, code: str | None = None):
    headers = {"x-request-id": rid} if rid else None
    return web.json_response(error_body(status, message, code), status=status, headers=headers)


class Proxy:
    """Owns everything with a lifetime: the upstream session, the health-check task, the
    KV-release tasks, the listening site. ``start()`` / ``stop()`` bracket it."""

    def __init__(self, settings: ProxySettings) -> None:
        self.settings = s = settings
        self.guard = ConnectionGuard(
            s.limits.max_connections, s.limits.header_timeout_s, self._limit_hit
        )
        self.metrics = ProxyMetrics(
            lambda: [*self.prefill.instances, *self.decode.instances],
            client_connections=lambda: self.guard.active,
        )
        self.prefill = Pool(
            "prefill",
            s.prefill,  # type: ignore[arg-type]
            s.prefill_policy,
            s.breaker,
            load_factor=s.prefix_load_factor,
            on_event=self._pool_event,
        )
        self.decode = Pool(
            "decode",
            s.decode,  # type: ignore[arg-type]
            s.decode_policy,
            s.breaker,
            load_factor=s.prefix_load_factor,
            on_event=self._pool_event,
        )
        self.bodies = BodyReader(s.limits, self._limit_hit)
        self.parser = BodyParser(s.limits)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._health_task: asyncio.Task[None] | None = None
        self.upstream: Upstream | None = None
        self.router: DisaggRouter | None = None
        self.shutting_down = False
        self._stopped = False
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self.app = self._build_app()

    # -- lifetime -----------------------------------------------------------------------

    def _pool_event(self, event: str, role: str, reason: str, url: str) -> None:
        self.metrics.pool_event(event, role, reason)
        open_s = self.settings.breaker.open_s
        if event == "ejected":
            logger.warning(
                "%s instance %s ejected for %gs after consecutive %s failures",
                role,
                url,
                open_s,
                reason,
            )
        elif event == "ejection_refused":
            logger.warning(
                "%s instance %s reached its %s-failure threshold but stays in: ejecting it"
                " would exceed max_ejection_percent or leave no serving %s instance",
                role,
                url,
                reason,
                role,
            )

    def _limit_hit(self, limit: str) -> None:
        self.metrics.limit_hits.labels(limit).inc()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a background task owned by the proxy (cancelled at shutdown)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_startup(self, app: web.Application) -> None:
        s = self.settings
        self.upstream = Upstream(s.timeouts, s.max_connections)
        self.router = DisaggRouter(
            s,
            self.upstream,
            self.metrics,
            self.prefill,
            self.decode,
            self.spawn,
            self.bodies,
            self.parser,
        )
        if s.health.interval_s > 0:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def _on_cleanup(self, app: web.Application) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._tasks:  # KV releases: short, bounded by their own timeout
            await asyncio.wait(list(self._tasks), timeout=self.settings.release_timeout_s)
            for t in list(self._tasks):
                t.cancel()
        if self.upstream is not None:
            await self.upstream.aclose()
        await self.parser.aclose()

    async def start(self, host: str, port: int) -> None:
        self._runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=1.0,
            keepalive_timeout=self.settings.limits.keepalive_timeout_s,
            logger=http_logger,
        )
        await self._runner.setup()
        self._site = GuardedSite(self._runner, host, port, self.guard, backlog=1024)
        await self._site.start()
        logger.info(
            "proxy listening on http://%s:%d (P: %s; D: %s)",
            host,
            port,
            ", ".join(self.prefill.urls) or "-",
            ", ".join(self.decode.urls) or "-",
        )

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful: stop accepting, let requests in flight finish up to ``grace_s``, then
        cancel the rest (their upstream connections close, so vLLM aborts them)."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        self.shutting_down = True
        if self._site is not None:
            await self._site.stop()  # closes the listening socket
        # Connections with no request being served (idle, or still sending headers) and
        # requests still sending their body hold nothing upstream: they go now, so a slow
        # client cannot stretch the shutdown.
        self.guard.close_waiting()
        self.bodies.cancel_reads()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        busy = self.router.inflight if self.router else 0
        if busy:
            logger.info("shutting down: %d requests in flight, waiting up to %gs", busy, grace)
        while self.router and self.router.inflight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.router and self.router.inflight:
            logger.warning("shutdown deadline: cancelling %d requests", self.router.inflight)
        if self._runner is not None:
            await self._runner.cleanup()

    # -- health -------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        h = self.settings.health
        while True:
            insts = [*self.prefill.instances, *self.decode.instances]
            if insts:
                await asyncio.gather(*(self._check(i) for i in insts))
            await asyncio.sleep(h.interval_s)

    async def _check(self, inst: Instance) -> None:
        h = self.settings.health
        assert self.upstream is not None
        try:
            status, _ = await self.upstream.get(inst.url, "/health", {}, h.timeout_s)
            err = None if status == 200 else f"/health answered {status}"
        except Exception as exc:  # any failure of the check is a failed check
            err = describe(exc)
        self.apply_check(inst, err)

    def apply_check(self, inst: Instance, err: str | None) -> None:
        """Thresholds: ``fall`` consecutive failures mark down, ``rise`` successes mark up."""
        h = self.settings.health
        inst.last_check_error = err
        if err is None:
            inst.check_failures, inst.check_successes = 0, inst.check_successes + 1
            if not inst.healthy and inst.check_successes >= h.rise:
                inst.healthy = True
                inst.breaker.success()
                logger.info("%s instance %s is up", inst.role, inst.url)
        else:
            inst.check_successes, inst.check_failures = 0, inst.check_failures + 1
            if inst.healthy and inst.check_failures >= h.fall:
                inst.healthy = False
                logger.warning("%s instance %s is down: %s", inst.role, inst.url, err)

    def ready(self) -> bool:
        return not self.shutting_down and self.prefill.has_eligible() and self.decode.has_eligible()

    # -- HTTP ---------------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application(
            middlewares=[self.guard.middleware, self._errors],
            client_max_size=self.settings.limits.max_body_bytes,
        )
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        r = app.router
        r.add_post("/v1/completions", self._completions)
        r.add_post("/v1/chat/completions", self._chat)
        r.add_get("/v1/models", self._models)
        r.add_get("/health", self._health)
        r.add_get("/ready", self._ready)
        r.add_get("/metrics", self._metrics)
        r.add_get("/admin/instances", self._admin_list)
        r.add_post("/admin/instances", self._admin_add)
        r.add_delete("/admin/instances", self._admin_remove)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        rid = _request_id(request)
        try:
            return await handler(request)
        except ProxyError as exc:
            resp = web.json_response(
                exc.body, status=exc.status, headers={**exc.headers, "x-request-id": rid}
            )
            if exc.hangup:
                await self._answer_and_close(request, resp)
            elif exc.close:
                resp.force_close()
            return resp
        except web.HTTPException as exc:
            if exc.status >= 400:
                return _json_error(exc.status, exc.reason, rid)
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:
            logger.error("request %s failed unexpectedly: %s", rid, one_line_exception(exc))
            return _json_error(500, f"proxy internal error: {type(exc).__name__}", rid)

    async def _answer_and_close(self, request: web.Request, resp: web.StreamResponse) -> None:
        """Send ``resp`` now and close the connection (the client's body is unread or it
        is too slow: no lingering read of the rest, no keep-alive)."""
        resp.force_close()
        with contextlib.suppress(ConnectionError):
            async with asyncio.timeout(self.settings.limits.write_timeout_s):
                await resp.prepare(request)
                await resp.write_eof()
        request.protocol.force_close()

    def _auth(self, request: web.Request) -> None:
        if not client_allowed(request.headers, self.settings.api_keys):
            raise ProxyError(401, "missing or invalid API key", "invalid_api_key")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self._auth(request)
        assert self.router is not None
        return await self.router.handle(request, "completions", _request_id(request))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self._auth(request)
        assert self.router is not None
        return await self.router.handle(request, "chat", _request_id(request))

    async def _models(self, request: web.Request) -> web.StreamResponse:
        self._auth(request)
        s = self.settings
        inst = self.decode.pick(panic=True)
        if inst is None or self.upstream is None:
            raise ProxyError(503, "no decode instance available", "no_instance")
        rid = _request_id(request)
        hdrs = backend_headers(request.headers, rid, s.backend_auth, s.backend_key)
        try:
            status, content = await self.upstream.get(
                inst.url, "/v1/models", hdrs, s.timeouts.connect_s * 2, leg="decode"
            )
        except Overloaded as exc:
            raise exc.error from None
        except Exception as exc:
            raise ProxyError(502, f"decode instance {inst.url} failed: {describe(exc)}") from exc
        return web.Response(
            body=content,
            status=status,
            content_type="application/json",
            headers={"x-request-id": rid},
        )

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"status": "ok"})

    async def _ready(self, request: web.Request) -> web.StreamResponse:
        body = {
            "ready": self.ready(),
            "prefill_healthy": sum(i.eligible() for i in self.prefill.instances),
            "decode_healthy": sum(i.eligible() for i in self.decode.instances),
            "shutting_down": self.shutting_down,
        }
        return web.json_response(body, status=200 if body["ready"] else 503)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"content-type": CONTENT_TYPE_LATEST},
        )

    # -- admin --------------------------------------------------------------------------

    def _admin(self, request: web.Request) -> None:
        key = self.settings.admin_key
        if not key:
            raise ProxyError(403, "admin API disabled (no admin key configured)")
        if not key_ok(bearer(request.headers), [key]):
            raise ProxyError(401, "missing or invalid admin key", "invalid_admin_key")

    def _pool(self, role: Any) -> Pool:
        if role == "prefill":
            return self.prefill
        if role == "decode":
            return self.decode
        raise ProxyError(400, "'role' must be 'prefill' or 'decode'")

    async def _admin_args(self, request: web.Request) -> dict[str, Any]:
        args: dict[str, Any] = dict(request.query)
        if request.can_read_body:
            raw = await self.bodies.read(request, ADMIN_MAX_BODY)
            try:
                data = json.loads(raw)
            except RecursionError as exc:
                raise ProxyError(400, "body is nested too deeply") from exc
            except ValueError as exc:
                raise ProxyError(400, f"body is not valid JSON: {exc}") from exc
            if not isinstance(data, dict):
                raise ProxyError(400, "body must be a JSON object")
            args.update(data)
        return args

    async def _admin_list(self, request: web.Request) -> web.StreamResponse:
        self._admin(request)
        return web.json_response(
            {"instances": [i.as_dict() for i in (*self.prefill.instances, *self.decode.instances)]}
        )

    async def _admin_add(self, request: web.Request) -> web.StreamResponse:
        self._admin(request)
        a = await self._admin_args(request)
        pool = self._pool(a.get("role"))
        # Validate everything (InstanceSpec checks URL, weight, side channel) before the
        # pool changes; Pool.add is atomic itself.
        try:
            spec = InstanceSpec(
                _admin_str(a.get("url", ""), "url"),
                _admin_weight(a.get("weight", 1.0)),
                a.get("side_channel"),
            )
            inst = pool.add(spec)
        except (ValueError, TypeError, OverflowError) as exc:
            raise ProxyError(400, str(exc)) from exc
        if self.upstream is not None and self.settings.health.interval_s > 0:
            self.spawn(self._check(inst))
        logger.info("admin: added %s instance %s (weight %g)", pool.role, spec.url, spec.weight)
        return web.json_response(inst.as_dict(), status=201)

    async def _admin_remove(self, request: web.Request) -> web.StreamResponse:
        self._admin(request)
        a = await self._admin_args(request)
        pool = self._pool(a.get("role"))
        try:
            inst = pool.remove(_admin_str(a.get("url", ""), "url"))
        except ValueError as exc:
            raise ProxyError(400, str(exc)) from exc
        except KeyError as exc:
            raise ProxyError(404, f"no {pool.role} instance {a.get('url')!r}") from exc
        logger.info(
            "admin: removing %s instance %s (%d in flight drain first)",
            pool.role,
            inst.url,
            inst.inflight,
        )
        return web.json_response(inst.as_dict(), status=202)


def _admin_str(value: Any, name: str) -> str:
    if not isinstance(value, str) or len(value) > 2048:
        raise ValueError(f"'{name}' must be a string of at most 2048 characters")
    return value


def _admin_weight(value: Any) -> float:
    """A number or a numeric string (query parameters); never a boolean."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"'weight' must be a number: {value!r}")
    try:
        if isinstance(value, str) and len(value) > 32:
            raise ValueError
        return float(value)
    except (ValueError, OverflowError):
        raise ValueError("'weight' must be a number") from None


PROXY_KEY = web.AppKey("proxy", Proxy)


def create_app(settings: ProxySettings) -> web.Application:
    """The aiohttp application of a new :class:`Proxy` (``app[PROXY_KEY]`` is the Proxy)."""
    proxy = Proxy(settings)
    proxy.app[PROXY_KEY] = proxy
    return proxy.app
