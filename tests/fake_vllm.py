"""FAKE vLLM backend: speaks just enough of vLLM's OpenAI API to drive exact proxy failures.

Not a model: it echoes what it was asked and records every request it received. The
``behavior`` dict switches failure modes per test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


class FakeVllm:
    def __init__(self, name: str) -> None:
        self.name = name
        self.received: list[dict[str, Any]] = []
        self.behavior: dict[str, Any] = {}
        # Requests whose client went away before the answer was complete (what vLLM aborts).
        self.cancelled: list[str] = []
        self.completed: list[str] = []  # streams sent to the end
        self.health_status = 200
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.kv_port = int(probe.getsockname()[1])
        self.health_calls = 0
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._complete, methods=["POST"]),
                Route("/v1/chat/completions", self._complete, methods=["POST"]),
                Route("/v1/models", self._models),
                Route("/health", self._health),
            ]
        )

    async def _health(self, request: Request) -> Response:
        self.health_calls += 1
        return Response(status_code=self.health_status)

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _complete(self, request: Request) -> Response:
        body = await request.json()
        self.received.append(
            {"path": request.url.path, "headers": dict(request.headers), "body": body}
        )
        b = self.behavior
        if "echo_error" in b:
            # A backend whose error message quotes the request it got (as pydantic's do).
            return JSONResponse(
                {"error": {"message": f"bad request: {json.dumps(body)}", "code": 0}},
                status_code=b["echo_error"],
            )
        if "status" in b:
            return JSONResponse(
                {
                    "error": {
                        "message": f"{self.name} says no",
                        "type": "BadRequestError",
                        "code": b["status"],
                    }
                },
                status_code=b["status"],
            )
        rid = request.headers.get("x-request-id", "")
        if "sleep" in b:
            # Poll for the client hanging up, as vLLM does, and record the abort.
            deadline = asyncio.get_running_loop().time() + b["sleep"]
            while asyncio.get_running_loop().time() < deadline:
                if await request.is_disconnected():
                    self.cancelled.append(rid)
                    return Response(status_code=499)
                await asyncio.sleep(0.02)
        is_prefill = bool((body.get("kv_transfer_params") or {}).get("do_remote_decode"))
        kv = None
        if is_prefill and not b.get("no_kv_params"):
            kv = {
                "do_remote_prefill": True,
                "transfer_id": f"{self.name}-t",
                "remote_host": "127.0.0.1",
                # A closed loopback port unless a test points it somewhere.
                "remote_port": b.get("kv_port", self.kv_port),
                "transfer_secret": "fake-secret",
                **b.get("kv_extra", {}),
            }
        text = f"{self.name}:{body.get('max_tokens')}"
        if body.get("stream"):
            return _Tracked(
                self, rid, self._sse(text, b, rid, request), media_type="text/event-stream"
            )
        return JSONResponse(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "choices": [{"index": 0, "text": text}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1},
                "kv_transfer_params": kv,
            }
        )

    async def _sse(
        self, text: str, b: dict[str, Any], rid: str = "", request: Request | None = None
    ):
        try:
            for i in range(b.get("chunks", 3)):
                if b.get("hang_after") == i:
                    await asyncio.sleep(3600)
                if b.get("chunk_delay"):
                    await asyncio.sleep(b["chunk_delay"])
                chunk = {"choices": [{"index": 0, "text": f"{text}#{i}" + "." * b.get("pad", 0)}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"
            # The server drops writes to a client that is gone without telling us: ask.
            if request is not None and await request.is_disconnected():
                self._aborted(rid)
            else:
                self.completed.append(rid)
        except (asyncio.CancelledError, GeneratorExit):
            self._aborted(rid)
            raise

    def _aborted(self, rid: str) -> None:
        if rid not in self.cancelled:
            self.cancelled.append(rid)


class _Tracked(StreamingResponse):
    """A stream whose client went away while the server was blocked sending (the
    generator is then abandoned, not closed) still counts as aborted."""

    def __init__(self, fake: FakeVllm, rid: str, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._fake, self._rid = fake, rid

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._rid not in self._fake.completed:
                self._fake._aborted(self._rid)


@contextlib.contextmanager
def fake_dead_socket() -> Iterator[str]:
    """FAKE backend that accepts TCP connections and closes them at once, unanswered."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    srv.settimeout(0.2)
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except (TimeoutError, OSError):
                continue
            with contextlib.suppress(OSError):
                conn.recv(65536)
            conn.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join(5)
        srv.close()


@contextlib.contextmanager
def fake_malformed_http() -> Iterator[str]:
    """FAKE backend that answers every request with a malformed HTTP response."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    srv.settimeout(0.2)
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except (TimeoutError, OSError):
                continue
            with contextlib.suppress(OSError):
                conn.settimeout(2)
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: zz\r\n\r\n")
            conn.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join(5)
        srv.close()
