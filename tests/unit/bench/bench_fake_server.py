"""A tiny OpenAI-style SSE server for the bench tests, with known delays and scripted failures.

Failures are scripted by arrival order (0-based), so error counts are exact no
matter which worker sends which request.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Script:
    ttft_delay: float = 0.15  # seconds from request to the first content chunk
    gap: float = 0.02  # seconds between content chunks
    pieces: int = 5  # content chunks per response
    tokens_per_piece: int = 2  # usage.completion_tokens = pieces * tokens_per_piece
    # arrival number -> "429" | "500" | "truncate" | "cut" | "stall" | "stream_error" | "empty"
    behaviours: dict[int, str] = field(default_factory=dict)
    stall_seconds: float = 5.0


class FakeOpenAI:
    def __init__(self, script: Script | None = None) -> None:
        self.script = script or Script()
        self.base_url = ""
        self.arrivals = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.auth_headers: list[str | None] = []
        self.model_ids: list[str] = ["first-model", "second-model"]  # what GET /v1/models lists

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_get("/v1/models", self.models)
        return app

    async def models(self, request: web.Request) -> web.StreamResponse:
        self.auth_headers.append(request.headers.get("Authorization"))
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.model_ids]})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        arrival = self.arrivals
        self.arrivals += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            body = await request.json()
            self.bodies.append(body)
            self.paths.append(request.path)
            self.auth_headers.append(request.headers.get("Authorization"))
            return await self._respond(request, body, self.script.behaviours.get(arrival, "ok"))
        finally:
            self.in_flight -= 1

    async def _respond(self, request: web.Request, body: dict[str, Any], behaviour: str) -> web.StreamResponse:
        script = self.script
        if behaviour in ("429", "500"):
            error = {"error": {"message": f"scripted {behaviour}", "type": "test", "code": behaviour}}
            return web.json_response(error, status=int(behaviour))
        if behaviour == "stall":
            await asyncio.sleep(script.stall_seconds)
        chat = request.path.endswith("/chat/completions")
        usage_on = bool(body.get("stream_options", {}).get("include_usage"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(payload: Any) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}\n\n".encode())

        def chunk(text: str | None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
            return {"object": "text_completion", "choices": [{"index": 0, "text": text or ""}]}

        # Chunks with nothing to show come first and must not stop the TTFT clock.
        await send(chunk(None, role=True))
        await send(chunk(""))
        await response.write(b": keep-alive comment\n\n")
        if behaviour == "empty":
            await send("[DONE]")
            return response
        await asyncio.sleep(script.ttft_delay)
        for i in range(script.pieces):
            if i:
                await asyncio.sleep(script.gap)
            await send(chunk(f"tok{i} "))
            if i == 1 and behaviour == "truncate":
                return response  # clean end of body, but no [DONE]
            if i == 1 and behaviour == "cut":
                assert request.transport is not None
                request.transport.close()  # connection dropped mid-stream
                return response
            if i == 1 and behaviour == "stream_error":
                await send({"error": {"message": "backend died", "type": "server_error"}})
                await send("[DONE]")
                return response
        if usage_on:
            tokens = script.pieces * script.tokens_per_piece
            await send(
                {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": tokens, "total_tokens": tokens + 7}}
            )
        await send("[DONE]")
        return response
