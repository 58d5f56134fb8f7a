"""The HTTP surface: routes, error mapping, and the lifespan that owns the upstream client."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from proxy.disagg import DisaggRouter, upstream_headers
from proxy.errors import ProxyError, error_body
from proxy.metrics import ProxyMetrics
from proxy.rewrite import validate_body
from proxy.settings import ProxySettings
from proxy.upstream import Upstream

logger = logging.getLogger("proxy.app")


def _request_id(request: Request) -> str:
    rid = request.headers.get("x-request-id", "").strip()
    return rid[:128] if rid else uuid.uuid4().hex


def create_app(settings: ProxySettings) -> FastAPI:
    metrics = ProxyMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        upstream = Upstream(settings.timeouts, settings.max_connections)
        app.state.upstream = upstream
        app.state.router = DisaggRouter(settings, upstream, metrics)
        try:
            yield
        finally:
            await upstream.aclose()

    app = FastAPI(title="pd-serve proxy", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.metrics = metrics

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
        return JSONResponse(
            exc.body, status_code=exc.status, headers={"x-request-id": _request_id(request)}
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request %s failed unexpectedly", _request_id(request))
        return JSONResponse(
            error_body(500, f"proxy internal error: {type(exc).__name__}"),
            status_code=500,
            headers={"x-request-id": _request_id(request)},
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code
        )

    async def _disagg(endpoint: str, request: Request) -> Response:
        rid = _request_id(request)
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            metrics.requests.labels(endpoint, "bad_request").inc()
            raise ProxyError(400, f"request body is not valid JSON: {exc}") from exc
        reason = validate_body(body, endpoint)
        if reason:
            metrics.requests.labels(endpoint, "bad_request").inc()
            raise ProxyError(400, reason)
        try:
            return await request.app.state.router.serve(endpoint, body, dict(request.headers), rid)
        except ProxyError as exc:
            metrics.requests.labels(endpoint, f"error_{exc.status}").inc()
            raise

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _disagg("completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _disagg("chat", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        router: DisaggRouter = request.app.state.router
        d_url = router.decode.urls[0]
        resp = await request.app.state.upstream.get_json(
            "decode",
            d_url,
            "/v1/models",
            upstream_headers(dict(request.headers), _request_id(request)),
        )
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
