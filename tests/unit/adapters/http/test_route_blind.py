"""A route service that knows no worker of a model the router's engines file serves (it is
restarting, or has not read ``workers`` yet) answers ``no_worker_for_model``; the router then
routes with its own policy instead of turning the request away with a 503 (seen in the lake
test: 88 of 300 requests refused while the restarted processor caught up)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import numpy as np
from aiohttp import web

from foretoken.adapters.engines.engines_file import EngineConfig
from foretoken.adapters.http.router.routing import Placement, Routing
from foretoken.core.routing.decide import decision
from foretoken.core.types import ModelName, RejectReason, RequestId
from foretoken.settings import load_settings
from foretoken.wire.records import Grant, as_record
from foretoken.wire.route_rpc import RouteResponse


def _placement(model: str) -> Placement:
    return Placement(
        request_id=RequestId("r1"), client_id=None, model=ModelName(model),
        token_ids=np.arange(64, dtype=np.uint32), max_queue_wait_s=None, already_waited_s=0.0,
        workload_class="default", prefer_cache_hit=False, conversation_id=None,
        expected_output_tokens=None,
    )  # fmt: skip


async def _decide(model: str) -> tuple[Grant, str | None, dict[str, int]]:
    async def route(request: web.Request) -> web.Response:
        p = _placement(model)
        none = RejectReason.NO_WORKER_FOR_MODEL
        refused = decision(p.query(), 0.0, None, admitted=False, reason=none, retry_after_s=120.0)
        body = msgspec.json.encode(RouteResponse(grant=as_record(Grant, refused)))
        return web.Response(body=body, content_type="application/json")

    engine = EngineConfig(worker_id="w0", model="m", http_url="http://127.0.0.1:1",
                          gpu_blocks=1024)  # fmt: skip
    async with _routing(route, {"w0": engine}) as routing:
        grant, url = await routing.decide(_placement(model))
    return grant, url, routing.fallbacks


@contextlib.asynccontextmanager
async def _routing(route: Any, engines: dict[str, EngineConfig]) -> AsyncIterator[Routing]:
    """The router's routing in front of a route service answering with ``route``."""
    app = web.Application()
    app.router.add_post("/v1/route", route)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    settings = load_settings(env={"FORETOKEN__ROUTER__ROUTE_URL": f"http://127.0.0.1:{port}"})
    routing = Routing(settings=settings, engines=engines)
    await routing.start()
    try:
        yield routing
    finally:
        await routing.stop()
        await runner.cleanup()


def test_a_blind_route_service_leaves_the_request_to_the_routers_policy() -> None:
    grant, url, fallbacks = asyncio.run(_decide("m"))
    assert grant.admitted and grant.fallback and grant.worker_id == "w0"
    assert url == "http://127.0.0.1:1"
    assert fallbacks == {"no_worker_at_route_service": 1}


def test_a_model_nobody_serves_is_still_refused_by_the_route_service() -> None:
    grant, url, fallbacks = asyncio.run(_decide("other"))
    assert not grant.admitted and grant.reject_reason == RejectReason.NO_WORKER_FOR_MODEL
    assert url is None and fallbacks == {}


def test_a_grant_for_an_engine_that_just_failed_goes_to_another() -> None:
    """The route service does not know yet that an engine stopped answering (a dead engine
    looks idle): the router replaces its grant for it by the fallback's among the others."""

    down: dict[str, float] = {}

    async def run() -> tuple[Grant, Grant, dict[str, int]]:
        async def route(request: web.Request) -> web.Response:
            p = _placement("m")
            chosen = decision(p.query(), 0.0, None, admitted=True, reason=None,
                              retry_after_s=None, worker_id="w0")  # fmt: skip
            body = msgspec.json.encode(RouteResponse(grant=as_record(Grant, chosen),
                                                     http_url="http://127.0.0.1:1"))  # fmt: skip
            return web.Response(body=body, content_type="application/json")

        engines = {w: EngineConfig(worker_id=w, model="m", http_url=f"http://127.0.0.1:{i + 1}")
                   for i, w in enumerate(("w0", "w1"))}  # fmt: skip
        async with _routing(route, engines) as routing:
            before, _ = await routing.decide(_placement("m"))
            assert routing.engines_down() == {}
            routing.unreachable("w0")
            down.update(routing.engines_down())  # what the router's /healthz lists
            after, _ = await routing.decide(_placement("m"))
        return before, after, routing.fallbacks

    before, after, fallbacks = asyncio.run(run())
    assert before.worker_id == "w0" and not before.fallback
    assert after.worker_id == "w1" and after.fallback and fallbacks == {"engine_down": 1}
    assert list(down) == ["w0"] and 0 < down["w0"] <= load_settings().router.engine_down_s
