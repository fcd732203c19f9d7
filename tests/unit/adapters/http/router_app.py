"""The router's whole app in-process, for tests of what a client and an engine see: the app
(``make_app``, its middlewares and handlers) behind aiohttp's test client, in front of a
fake engine that records every request and streams a chat or completion answer. The route
service and Kafka are unreachable ports: the router decides alone, and its records stay
in its buffer (emptied at the end, so that its shutdown does not wait on them)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from foretoken.adapters.engines.engines_file import EngineConfig
from foretoken.adapters.http.router.app import make_app
from foretoken.adapters.http.router.path import STATE
from foretoken.adapters.ports import free_port
from foretoken.settings import load_settings

MODEL = "m"


@dataclass
class FakeEngine:
    """What the engine was sent (path, headers, JSON body), and the events it streams to
    a chat or completion request (each a JSON object; ``[DONE]`` after them)."""

    events: list[dict[str, Any]] = field(default_factory=list)
    seen: list[tuple[str, dict[str, str], Any]] = field(default_factory=list)  # names lowercase

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = msgspec.json.decode(await request.read())
        self.seen.append((request.path, {k.lower(): v for k, v in request.headers.items()}, body))
        if request.path == "/v1/embeddings":
            return web.json_response({"object": "list", "data": [], "model": MODEL})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in self.events:
            await response.write(b"data: " + msgspec.json.encode(event) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response


def chat_events(text: str = "hi", usage_every_chunk: bool = False) -> list[dict[str, Any]]:
    """A chat answer of one word, a finish and the usage event (with ``usage_every_chunk``,
    a usage on every chunk too: vLLM's ``continuous_usage_stats``)."""
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    each = {"usage": usage} if usage_every_chunk else {}
    return [
        {"object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": text}}], **each},
        {"object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {}, "finish_reason": "stop"}], **each},
        {"object": "chat.completion.chunk", "choices": [], "usage": usage},
    ]  # fmt: skip


@contextlib.asynccontextmanager
async def running_router(engine: FakeEngine | None = None,
                         **config: Any) -> AsyncIterator[TestClient[Any, Any]]:  # fmt: skip
    """A client of the router app in front of ``engine`` (none: an address nothing answers
    at); ``config``: the engine's other EngineConfig fields (a tokenizer, a chat template)."""
    fake = engine or FakeEngine()
    engine_app = web.Application()
    engine_app.router.add_route("POST", "/{tail:.*}", fake.handle)
    async with TestServer(engine_app) as engine_server:
        url = str(engine_server.make_url("")).rstrip("/")
        if engine is None:
            url = f"http://127.0.0.1:{free_port()}"
        settings = load_settings(env={
            "FORETOKEN__ROUTER__ROUTE_URL": f"http://127.0.0.1:{free_port()}",
            "FORETOKEN__KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}",
        })  # fmt: skip
        worker = EngineConfig(worker_id="w0", model=MODEL, http_url=url, gpu_blocks=1024,
                              **config)  # fmt: skip
        app = make_app(settings, [worker])
        async with TestClient(TestServer(app)) as client:
            try:
                yield client
            finally:
                queue = app[STATE].publisher.queue
                while not queue.empty():
                    queue.get_nowait()
                    queue.task_done()
