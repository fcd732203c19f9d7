"""The processor's web pages (served by Faust's web server on ``worker.web_host`` and
``worker.web_port``): ``/healthz /metrics /v1/stats /v1/config /v1/route /v1/cache/{model}
/v1/fits /v1/controls``. The two that take a body (``POST /v1/route``, ``POST
/v1/cache/{model}``) read it with limits, need ``route.token`` when one is set, and answer
every bad input with a 4xx JSON error naming the field (``adapters/http/route_page.py``)."""

from __future__ import annotations

import time
from typing import cast

import faust
import msgspec
from aiohttp import web
from faust.web import Request, Response, View

from foretoken import __version__
from foretoken.adapters.http.route_page import (
    authorized,
    error_body,
    read_body,
    read_route_request,
)
from foretoken.adapters.kafka.metrics import PROMETHEUS_CONTENT_TYPE
from foretoken.adapters.kafka.processor import ProcessorState
from foretoken.wire.route_rpc import RouteRequestError, TokenId

JSON = "application/json"


class CacheQuery(msgspec.Struct, frozen=True):
    """``POST /v1/cache/{model}``: which prompt to look up."""

    token_ids: tuple[TokenId, ...]


def _error(view: View, exc: RouteRequestError) -> Response:
    code = "unauthorized" if exc.status == 401 else "invalid_route_request"
    return view.bytes(error_body(exc.message, exc.field, code), status=exc.status,
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
    @app.page("/healthz")
    async def healthz(self: View, request: Request) -> Response:
        return self.json({"status": "ok", "version": __version__})

    @app.page("/metrics")
    async def metrics(self: View, request: Request) -> Response:
        return self.bytes(state.metrics.render(), content_type=PROMETHEUS_CONTENT_TYPE)

    @app.page("/v1/stats")
    async def stats(self: View, request: Request) -> Response:
        return self.json(state.stats())

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
            return self.bytes(state.route(route), content_type=JSON)

    @app.page("/v1/controls")
    async def controls(self: View, request: Request) -> Response:
        if state.controls is None:
            return self.json({"enabled": False})
        body = state.controls.snapshot(time.time())
        body["recent"] = [msgspec.to_builtins(e) for e in list(state.controls.history)[-50:]]
        return self.json(body)

    @app.page("/v1/fits")
    async def fits(self: View, request: Request) -> Response:
        return self.json({"fits": state.fits.describe()})

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
