"""FAKE OpenAI-compatible server for load-generator tests: not a model, a token metronome.

Answers /v1/completions and /v1/chat/completions with ``max_tokens`` (or
``max_completion_tokens``) tokens "tok", the first after ``first_delay_s`` and each next
after ``token_delay_s``, streamed as SSE (with a trailing usage chunk when asked) or as one
JSON body. ``behavior`` switches exact failure cases; ``received`` records every body.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


class FakeOpenAIStream:
    def __init__(self, first_delay_s: float = 0.02, token_delay_s: float = 0.005) -> None:
        self.first_delay_s = first_delay_s
        self.token_delay_s = token_delay_s
        self.received: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        # fail_every: HTTP 500 on every Nth request; status: every request fails with it;
        # hang: answer nothing for that many seconds; no_usage: omit usage;
        # drop_after: end the stream after k tokens, without [DONE].
        self.behavior: dict[str, Any] = {}
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._complete, methods=["POST"]),
                Route("/v1/chat/completions", self._complete, methods=["POST"]),
                Route("/v1/models", self._models),
                Route("/health", lambda r: Response()),
            ]
        )

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-tiny", "object": "model"}]})

    async def _complete(self, request: Request) -> Response:
        body = await request.json()
        self.received.append({"path": request.url.path, "body": body, "t": time.monotonic()})
        n = len(self.received)
        b = self.behavior
        if "status" in b or (b.get("fail_every") and n % b["fail_every"] == 0):
            code = b.get("status", 500)
            return JSONResponse({"error": {"message": "fake says no", "code": code}}, code)
        if b.get("hang"):
            await asyncio.sleep(float(b["hang"]))  # seconds; keep it short so shutdown is quick
        chat = request.url.path.endswith("/chat/completions")
        n_out = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        prompt = body["messages"][-1]["content"] if chat else body.get("prompt", "")
        n_in = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
        if not body.get("stream"):
            await asyncio.sleep(self.first_delay_s + self.token_delay_s * (n_out - 1))
            text = "tok" * n_out
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if chat
                else {"index": 0, "text": text}
            )
            return JSONResponse({"id": f"x-{n}", "choices": [choice], "usage": usage})
        want_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            self._sse(chat, n_out, usage if want_usage and not b.get("no_usage") else None),
            media_type="text/event-stream",
        )

    async def _sse(
        self, chat: bool, n_out: int, usage: dict[str, int] | None
    ) -> AsyncIterator[str]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.first_delay_s)
            for i in range(n_out):
                if i:
                    await asyncio.sleep(self.token_delay_s)
                if self.behavior.get("drop_after") == i:
                    return
                choice = (
                    {"index": 0, "delta": {"content": "tok"}}
                    if chat
                    else {"index": 0, "text": "tok"}
                )
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            if usage is not None:
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1
