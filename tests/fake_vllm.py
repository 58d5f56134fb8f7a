"""FAKE vLLM backend: speaks just enough of vLLM's OpenAI API to drive exact proxy failures.

Not a model: it echoes what it was asked and records every request it received. The
``behavior`` dict switches failure modes per test.
"""

from __future__ import annotations

import asyncio
import json
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
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._complete, methods=["POST"]),
                Route("/v1/chat/completions", self._complete, methods=["POST"]),
                Route("/v1/models", self._models),
                Route("/health", lambda r: Response()),
            ]
        )

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _complete(self, request: Request) -> Response:
        body = await request.json()
        self.received.append(
            {"path": request.url.path, "headers": dict(request.headers), "body": body}
        )
        b = self.behavior
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
        if "sleep" in b:
            await asyncio.sleep(b["sleep"])
        is_prefill = bool((body.get("kv_transfer_params") or {}).get("do_remote_decode"))
        kv = None
        if is_prefill and not b.get("no_kv_params"):
            kv = {
                "do_remote_prefill": True,
                "transfer_id": f"{self.name}-t",
                "remote_host": "127.0.0.1",
                "remote_port": 17100,
            }
        text = f"{self.name}:{body.get('max_tokens')}"
        if body.get("stream"):
            return StreamingResponse(self._sse(text, b), media_type="text/event-stream")
        return JSONResponse(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "choices": [{"index": 0, "text": text}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1},
                "kv_transfer_params": kv,
            }
        )

    async def _sse(self, text: str, b: dict[str, Any]):
        for i in range(b.get("chunks", 3)):
            if b.get("hang_after") == i:
                await asyncio.sleep(3600)
            chunk = {"choices": [{"index": 0, "text": f"{text}#{i}"}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"
