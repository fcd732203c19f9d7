"""The processor's web pages (served by Faust's web server on ``worker.web_port``):
``/healthz /metrics /v1/stats /v1/config /v1/route /v1/cache/{model} /v1/fits /v1/controls``."""

from __future__ import annotations

import time

import faust
import msgspec
from faust.web import Request, Response, View

from foretoken import __version__
from foretoken.adapters.kafka.metrics import PROMETHEUS_CONTENT_TYPE
from foretoken.adapters.kafka.processor import ProcessorState
from foretoken.wire.codec import DecodeError


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
                body = state.route(await request.read())
            except DecodeError as exc:
                return self.json({"error": exc.reason}, status=400)
            return self.bytes(body, content_type="application/json")

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
            body = await request.json()
            tokens = body.get("token_ids") if isinstance(body, dict) else None
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                return self.json({"error": "token_ids must be a list of ints"}, status=400)
            return self.json(state.index.lookup_page(model, tokens))
