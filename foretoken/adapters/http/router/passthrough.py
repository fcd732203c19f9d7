"""The engines' endpoints that generate nothing, passed through: embeddings, pooling,
classification, scores and reranking, tokenize and detokenize (vLLM's paths, which
SGLang and llama.cpp's server share where they serve the same thing).

There is no first token to predict or measure, so nothing is routed through the route
service or graded: the body (JSON, under the router's size and time limits) goes untouched
to the engine of its ``model`` (a LoRA adapter: one that serves it; no ``model`` when one
model is served: that one) with the fewest requests in flight from this router, in turn
among equals, skipping engines found down; the engine's answer — status, media type,
body — comes back as it is, with the router's ``x-request-id`` (an error whose body is not
JSON, in OpenAI's error shape). The engine gets that id too, one per request as for a
routed one (a client's ``x-request-id`` the first time, ``<id>~<n>`` after): an engine that
takes it as its request id never sees a client's fixed id twice at once. An engine that
does not serve the path answers its own 404, passed on; one that does not answer is a 502
(504 when silent past ``router.engine_timeout_s``) and is skipped for
``router.engine_down_s``.
"""

from __future__ import annotations

import itertools
from typing import Final

import aiohttp
import msgspec
from aiohttp import web

from foretoken.adapters.engines.engines_file import EngineConfig
from foretoken.adapters.http.router import edge, errors
from foretoken.adapters.http.router.path import (
    STATE,
    RouterState,
    check_model,
    refused,
    unauthorized,
)
from foretoken.adapters.http.router.requests import RequestError, json_error
from foretoken.adapters.http.router.routing import check_id

PATHS: Final = (
    "/v1/embeddings", "/pooling", "/classify", "/v1/classify", "/score", "/v1/score",
    "/rerank", "/v1/rerank", "/v2/rerank", "/tokenize", "/detokenize",
)  # fmt: skip
# the answer's headers kept (the rest — length, encoding, connection — are this hop's)
_KEPT: Final = ("Content-Type", "Retry-After")
_turn = itertools.count()


class _Named(msgspec.Struct):
    model: str | None = None


_named = msgspec.json.Decoder(_Named)
_any = msgspec.json.Decoder()


async def forward(request: web.Request) -> web.StreamResponse:
    """POST the body to an engine of its model at the same path; its answer as it is."""
    state = request.app[STATE]
    if not state.authorized(request):
        return unauthorized(False)
    try:
        given = request.headers.get("x-request-id") or None
        if given is not None:
            check_id("x-request-id", given)
        # the router's id, as a routed request's: the client's the first time, then <id>~<n>
        # (an engine that takes it as its request id never sees one twice at once)
        request_id = state.routing.attempt(given, 0.0)[0]
        raw = await edge.read_body(request, state.settings)
        try:
            model = _named.decode(raw).model
        except (msgspec.DecodeError, RecursionError) as exc:
            raise json_error(exc, raw) from exc
        if model is None:
            if len(state.models) != 1:
                raise RequestError(f"model is required (served: {state.models})", param="model")
            model = state.models[0]
        check_model(state, model)
        engine = pick(state, model)
    except RequestError as exc:
        return refused(state, exc, False)
    headers = state.upstream_headers(request, request_id, engine)
    assert state.engine_session is not None
    state.routing.sent(engine.worker_id, 1)  # one request (counted as one token) in flight
    try:
        async with state.engine_session.post(engine.http_url + request.path, data=raw,
                                             headers=headers,
                                             timeout=state.engine_timeout) as resp:  # fmt: skip
            body = await resp.read()
            kept = {k: v for k in _KEPT if (v := resp.headers.get(k)) is not None}
            if resp.status >= 400 and not _is_json(body):  # (aiohttp's "404: Not Found")
                text = body[:300].decode(errors="replace").strip() or f"{resp.status}"
                return errors.openai_error(resp.status, f"engine {engine.worker_id} answered "
                                           f"{request.path}: {text}",
                                           "api_error" if resp.status >= 500
                                           else "invalid_request_error",
                                           headers={"x-request-id": request_id})  # fmt: skip
            return web.Response(status=resp.status, body=body,
                                headers=kept | {"x-request-id": request_id})  # fmt: skip
    except (aiohttp.ClientError, TimeoutError) as exc:
        state.routing.unreachable(engine.worker_id)
        status = 504 if isinstance(exc, TimeoutError) else 502
        return errors.openai_error(status, f"engine {engine.worker_id} did not answer: "
                                   f"{type(exc).__name__}: {exc}".rstrip(": "), "api_error",
                                   headers={"x-request-id": request_id})  # fmt: skip
    finally:
        state.routing.sent(engine.worker_id, -1)


def _is_json(body: bytes) -> bool:
    try:
        _any.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return False
    return True


def pick(state: RouterState, model: str) -> EngineConfig:
    """The engine of ``model`` (or of the adapter it names) with the fewest requests in
    flight from this router, in turn among equals; engines found down only when all are."""
    serving = [e for e in state.engines.values()
               if e.model == model or model in e.lora_adapters]  # fmt: skip
    up = [e for e in serving if not state.routing.is_down(e.worker_id)] or serving
    if not up:
        raise RequestError(f"no engine serves {model!r}", status=404, param="model",
                           code="model_not_found")  # fmt: skip
    load = state.routing.outstanding
    fewest = min(load[e.worker_id].requests if e.worker_id in load else 0 for e in up)
    tied = [e for e in up if (load[e.worker_id].requests if e.worker_id in load else 0) == fewest]
    return tied[next(_turn) % len(tied)]


def add_routes(app: web.Application) -> None:
    for path in PATHS:
        app.router.add_post(path, forward)
