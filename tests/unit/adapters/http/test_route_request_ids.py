"""The router owns its request ids: every request gets its own, whatever ``x-request-id`` the
client sends. Before: a client that sent one id for every request got the first request's
decision again (same length; a duplicate grant and outcomes under one id) or a 409 its SDK
retried four times (another length); and the engine got the client's id, not the router's,
so concurrent requests with one fixed id were one id twice to an engine that takes the
header as its request id (vLLM ``--enable-request-id-headers``)."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
from aiohttp import web

from foretoken.adapters.engines.engines_file import EngineConfig
from foretoken.adapters.http.router.routing import Placement, Routing
from foretoken.core.routing.decide import decision
from foretoken.core.types import ModelName, RequestId, WorkerId
from foretoken.settings import load_settings
from foretoken.wire.records import Grant, as_record
from foretoken.wire.route_rpc import RouteRequest, RouteResponse
from tests.unit.adapters.http.router_app import MODEL, FakeEngine, chat_events, running_router


def _placement(request_id: str, client_id: str | None) -> Placement:
    return Placement(
        request_id=RequestId(request_id), client_id=client_id, model=ModelName("m"),
        token_ids=np.arange(64, dtype=np.uint32), max_queue_wait_s=None, already_waited_s=0.0,
        workload_class="default", prefer_cache_hit=False, conversation_id=None,
        expected_output_tokens=None,
    )  # fmt: skip


def _routing(url: str = "http://127.0.0.1:9") -> Routing:
    settings = load_settings(env={"FORETOKEN__ROUTER__ROUTE_URL": url})
    engine = EngineConfig(worker_id="w0", model="m", http_url="http://127.0.0.1:1",
                          gpu_blocks=1024)  # fmt: skip
    return Routing(settings=settings, engines={"w0": engine})


def test_one_client_id_on_many_requests_gets_an_id_per_request() -> None:
    routing = _routing()
    ids = [routing.attempt("fixed", 0.0)[0] for _ in range(3)]
    assert ids == ["fixed", "fixed~2", "fixed~3"]
    assert routing.attempt(None, 0.0)[0] != routing.attempt(None, 0.0)[0]


def test_a_retry_after_a_429_counts_the_time_since_the_first_refusal() -> None:
    routing = _routing()
    first, waited = routing.attempt("c", 0.0)
    assert (first, waited) == ("c", 0.0)
    routing.rejected("c")
    routing.attempts["c"] -= 5.0  # refused five seconds ago
    retry, waited = routing.attempt("c", 1.0)
    assert retry == "c~2" and waited >= 5.0
    routing.admitted("c")
    assert routing.attempt("c", 1.0) == ("c~3", 1.0)  # admitted: waiting is over


async def _decide_against_a_service_that_knows_the_id() -> tuple[Grant, list[str]]:
    seen: list[str] = []

    async def route(request: web.Request) -> web.Response:
        query = msgspec.msgpack.decode(await request.read(), type=RouteRequest)
        seen.append(query.request_id)
        if query.request_id == "taken":  # another router process placed another prompt
            return web.json_response({"error": "request id reused"}, status=409)
        p = _placement(query.request_id, None)
        admitted = decision(p.query(), 0.0, None, admitted=True, reason=None,
                            retry_after_s=None, worker_id=WorkerId("w0"))  # fmt: skip
        body = msgspec.json.encode(RouteResponse(grant=as_record(Grant, admitted),
                                                 http_url="http://127.0.0.1:1"))  # fmt: skip
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/route", route)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    routing = _routing(f"http://127.0.0.1:{port}")
    await routing.start()
    try:
        grant, _ = await routing.decide(_placement("taken", "taken"))
    finally:
        await routing.stop()
        await runner.cleanup()
    return grant, seen


def test_an_id_the_route_service_placed_for_another_request_is_replaced_not_a_409() -> None:
    grant, seen = asyncio.run(_decide_against_a_service_that_knows_the_id())
    assert grant.admitted and grant.worker_id == "w0"
    assert seen[0] == "taken" and len(seen) == 2
    assert grant.request_id == seen[1] and seen[1].startswith("taken~")


async def test_the_engine_gets_the_routers_id_of_each_request_not_the_clients() -> None:
    engine = FakeEngine(events=chat_events())
    fixed = {"x-request-id": "fixed"}
    chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    async with running_router(engine) as client:
        answers = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=chat, headers=fixed) for _ in range(3)),
            client.post("/v1/embeddings", json={"model": MODEL, "input": "x"}, headers=fixed),
        )  # fmt: skip
        assert [r.status for r in answers] == [200] * 4
        given = sorted(r.headers["x-request-id"] for r in answers)
    assert sorted(headers["x-request-id"] for _, headers, _ in engine.seen) == given
    assert given == ["fixed", "fixed~2", "fixed~3", "fixed~4"]  # each its own, passthrough too
    quiet = FakeEngine(events=chat_events())  # an engine that refuses the header gets none
    async with running_router(quiet, request_id_header=False) as client:
        assert (await client.post("/v1/chat/completions", json=chat, headers=fixed)).status == 200
        assert (await client.post("/v1/embeddings", json={"model": MODEL}, headers=fixed)).ok
    assert [p for p, headers, _ in quiet.seen if "x-request-id" in headers] == []
