"""The processor's web pages (served by Faust's web server on ``worker.web_host`` and
``worker.web_port``): ``/healthz /metrics /v1/stats /v1/staleness /v1/config /v1/route
/v1/cache/{model} /v1/fits /v1/controls``. The two that take a body (``POST /v1/route``,
``POST /v1/cache/{model}``) read it with limits, need ``route.token`` when one is set, and
answer every bad input with a 4xx JSON error naming the field (``adapters/http/route_page.py``).

``/healthz`` is the readiness a router checks (:mod:`foretoken.adapters.kafka.lag`: a route
replica answers 503 while it catches up). ``/v1/route`` on a route instance sharded by model
forwards a request for a model it does not own to the owner (from the ``members`` topic),
once: a forwarded request that still lands on a non-owner gets 421, one with no owner known
503 (the router then tries another route service, then decides alone).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import cast

import aiohttp
import faust
import msgspec
from aiohttp import web
from faust.web import Request, Response, View

from foretoken.adapters.http.route_page import (
    TOKEN_HEADER,
    authorized,
    error_body,
    read_body,
    read_route_request,
)
from foretoken.adapters.kafka.metrics import PROMETHEUS_CONTENT_TYPE
from foretoken.adapters.kafka.processor import ProcessorState
from foretoken.wire.route_rpc import RouteRequestError, TokenId

log = logging.getLogger(__name__)
JSON = "application/json"
FORWARDED_HEADER = "x-foretoken-forwarded"
FORWARD_TIMEOUT_S = 5.0


class CacheQuery(msgspec.Struct, frozen=True):
    """``POST /v1/cache/{model}``: which prompt to look up."""

    token_ids: tuple[TokenId, ...]


def _error(view: View, exc: RouteRequestError) -> Response:
    code = "unauthorized" if exc.status == 401 else "invalid_route_request"
    response = view.bytes(error_body(exc.message, exc.field, code), status=exc.status,
                          content_type=JSON)  # fmt: skip
    if exc.status in (408, 413, 415) and isinstance(response, web.StreamResponse):
        response.force_close()  # the rest of the body is never read (nor drained, inflated)
    return response


def _unavailable(view: View, message: str, status: int) -> Response:
    """The owner of a model cannot answer: the OpenAI error shape, as every other error."""
    return view.bytes(error_body(message, "model", "model_owner_unavailable"), status=status,
                      content_type=JSON)  # fmt: skip


def _aiohttp(request: Request) -> web.Request:
    return cast(web.Request, request)  # Faust's aiohttp driver hands aiohttp's request on


async def _cache_query(request: Request, state: ProcessorState, limit: int) -> CacheQuery:
    cfg = state.settings.route
    if not authorized(request.headers, cfg):
        raise RouteRequestError("the cache lookup needs the route token", None, 401)
    body = await read_body(_aiohttp(request), cfg)
    try:
        query = msgspec.json.decode(body, type=CacheQuery)
    except msgspec.ValidationError as exc:
        raise RouteRequestError(
            f"token_ids must be a list of token ids: {exc}", "token_ids"
        ) from exc
    except (msgspec.DecodeError, RecursionError) as exc:
        raise RouteRequestError(f"the body is not a JSON object: {exc}", None) from exc
    if len(query.token_ids) > limit:
        raise RouteRequestError(f"token_ids: more than {limit} tokens", "token_ids")
    return query


def add_pages(app: faust.App, state: ProcessorState) -> None:
    sessions: list[aiohttp.ClientSession] = []

    @app.page("/healthz")
    async def healthz(self: View, request: Request) -> Response:
        status, body = state.health()
        body["event_loop"] = type(asyncio.get_running_loop()).__module__.split(".")[0]
        return self.json(body, status=status)

    @app.page("/metrics")
    async def metrics(self: View, request: Request) -> Response:
        state.metrics.observe_state(state.health()[1], state.memory())
        return self.bytes(state.metrics.render(), content_type=PROMETHEUS_CONTENT_TYPE)

    @app.page("/v1/stats")
    async def stats(self: View, request: Request) -> Response:
        return self.json(state.stats())

    @app.page("/v1/staleness")
    async def staleness(self: View, request: Request) -> Response:
        """Queue-view staleness since ``?since=<unix ts>`` (default: all kept samples)."""
        try:
            since = float(request.query.get("since", 0.0))
            if not math.isfinite(since):
                raise ValueError(since)
        except ValueError:
            body = error_body("since must be a unix time in seconds", "since", "invalid_query")
            return self.bytes(body, status=400, content_type=JSON)
        return self.json(state.staleness_since(since))

    @app.page("/v1/config")
    async def config(self: View, request: Request) -> Response:
        return self.json(state.effective_config())

    @app.page("/v1/route")
    class RoutePage(View):
        async def post(self, request: Request) -> Response:
            try:
                route = await read_route_request(_aiohttp(request), state.settings.route)
            except RouteRequestError as exc:
                return _error(self, exc)
            if not state.owns(route.model):
                raw = msgspec.msgpack.encode(route)
                return await self._forward(request, raw, state.owner_of(route.model))
            try:
                answer = state.route(route)
            except RouteRequestError as exc:  # e.g. 409: the id names another request
                return _error(self, exc)
            except Exception as exc:  # a bug must not answer a bare 500 with no reason
                log.exception("route request %r failed", route.request_id)
                message = f"the route service failed on this request: {type(exc).__name__}: {exc}"
                return self.bytes(error_body(message[:512], None, "route_failed"), status=500,
                                  content_type=JSON)  # fmt: skip
            return self.bytes(answer, content_type=JSON)

        async def _forward(self, request: Request, raw: bytes, owner: object) -> Response:
            url = getattr(owner, "url", None)
            if request.headers.get(FORWARDED_HEADER) or url is None:
                status = 421 if request.headers.get(FORWARDED_HEADER) else 503
                message = ("not the owner of this model, and no owner known" if url is None
                           else "forwarded to a non-owner")  # fmt: skip
                return _unavailable(self, message, status)
            if not sessions:
                sessions.append(aiohttp.ClientSession())
            state.forwarded += 1
            forward_headers = {"Content-Type": "application/msgpack",
                               FORWARDED_HEADER: state.settings.instance_id}  # fmt: skip
            if state.settings.route.token:
                forward_headers[TOKEN_HEADER] = state.settings.route.token
            try:
                async with sessions[0].post(
                    f"{url}/v1/route", data=raw,
                    headers=forward_headers,
                    timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT_S),
                ) as resp:  # fmt: skip
                    body = await resp.read()
                    return self.bytes(body, content_type="application/json", status=resp.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                return _unavailable(self, f"owner {url} unreachable: {exc}", 503)

    @app.page("/v1/controls")
    async def controls(self: View, request: Request) -> Response:
        if state.controls is None:
            return self.json({"enabled": False})
        body = state.controls.snapshot(time.time())
        body["recent"] = [msgspec.to_builtins(e) for e in list(state.controls.history)[-50:]]
        return self.json(body)

    @app.page("/v1/fits")
    async def fits(self: View, request: Request) -> Response:
        service = state.core.service
        preds, workers = service.predictions, sorted(service.book.profiles)
        scale = preds.wait_scale
        return self.json({
            "fits": state.fits.describe(),
            # per worker: the learned load cost of each lower tier, and its queue-wait scale
            "tier_load": {w: preds.tier_costs.describe(w) for w in workers},
            "wait_scale": {w: scale.factor(w) if scale is not None else 1.0 for w in workers},
            # per model: the answer lengths learned for max_tokens caps (core/routing/outputs)
            "output_lengths": service.outputs.describe(),
        })  # fmt: skip

    @app.page("/v1/cache/{model}")
    class CachePage(View):
        async def get(self, request: Request, model: str) -> Response:
            return self.json(state.index.cache_page(model))

        async def post(self, request: Request, model: str) -> Response:
            """Body ``{"token_ids": [...]}``: every worker's cached prefix of that prompt."""
            try:
                query = await _cache_query(request, state, state.settings.route.max_prompt_tokens)
            except RouteRequestError as exc:
                return _error(self, exc)
            return self.json(state.index.lookup_page(model, list(query.token_ids)))
