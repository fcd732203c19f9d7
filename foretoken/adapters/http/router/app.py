"""The thin router in front of the engines: ``foretoken router``.

OpenAI (``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``,
``/v1/models[/{id}]``) and Anthropic (``/v1/messages``, ``/v1/messages/count_tokens``)
surfaces; ``/health``, ``/healthz``, ``/metrics``; the engines' endpoints that generate
nothing (embeddings, scores, tokenize, …) passed through (``passthrough.py``); SGLang's
``/generate`` (``native.py``). Per request:
read the body (size limit, read timeout), decode it once into typed structs
(``requests.py``, ``anthropic.py``, ``responses.py``; big bodies in a thread; a batch of
prompts split, ``batch.py``), tokenize (long texts in a thread), ask the route service
(``routing.py``) — or, when it is slow or down, decide alone — then either answer 429 at
once (``errors.py``) or forward to the chosen engine and relay its answer (``proxy.py``).
Grants and outcomes go to Kafka through a bounded buffer, never on the request path.
uvloop; several processes on one port when ``router.processes`` > 1 (SO_REUSEPORT).

aiohttp rather than FastAPI: the router is a byte-level streaming proxy; aiohttp gives the
client session and the server in one small dependency that the processor (Faust) already uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import generate_latest

from foretoken.adapters.engines.engines_file import EngineConfig
from foretoken.adapters.heap import freeze_startup_heap
from foretoken.adapters.http.router import (
    anthropic,
    batch,
    edge,
    errors,
    native,
    passthrough,
    responses,
    responses_relay,
)
from foretoken.adapters.http.router.path import (
    SSE_HEADERS,
    STATE,
    EventStream,
    RouterState,
    check_model,
    off_loop,
    place,
    refused,
    relay_to_engine,
    route,
    tokens_of,
    unauthorized,
)
from foretoken.adapters.http.router.proxy import (
    ClientGone,
    Collected,
    OpenAIStream,
)
from foretoken.adapters.http.router.publisher import Publisher
from foretoken.adapters.http.router.requests import RequestError, decode_openai
from foretoken.adapters.http.tokenizers import Tokenizers
from foretoken.adapters.processes import port_taken
from foretoken.settings import Settings
from foretoken.wire.records import Grant

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()
# ---------------------------------------------------------------------- handlers


async def openai_request(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    arrived = time.monotonic()
    if not state.authorized(request):
        return unauthorized(False)
    try:
        raw = await edge.read_body(request, state.settings)
        d = await off_loop(state, len(raw), decode_openai, raw, chat,
                           state.settings.router.max_output_tokens,
                           state.settings.router.max_batch_prompts)  # fmt: skip
        check_model(state, d.body.model)
        if d.batch:  # several prompts: each routed as its own request
            return await batch.completions(request, state, d, arrived)
        text = (await state.tokenizers.chat_text(d.body.model, d.text or "", d.json_fields,
                                                 len(raw)) if chat else d.text)  # fmt: skip
        tokens = await tokens_of(state, d.body.model, text, d.token_ids,
                                 "messages" if chat else "prompt", d.special_tokens)  # fmt: skip
        p = await place(state, request, d.body, tokens, d.max_output_tokens)
        routed = await route(state, p, False)
    except RequestError as exc:
        return refused(state, exc, False)
    if isinstance(routed, web.Response):
        return routed
    grant, url, p = routed
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = EventStream(headers={**SSE_HEADERS, "x-request-id": p.request_id})
    cached = state.reports_cached(grant)
    relay: OpenAIStream | Collected = (
        OpenAIStream(request, response, chat, d.wants_usage, d.body.n or 1, cached)
        if d.body.stream else Collected(chat, cached)
    )  # fmt: skip
    m = await relay_to_engine(state, request, p, grant, url + path, d.upstream, relay, arrived)
    if m is None:  # the client went away mid-stream
        return response
    if m.engine_status != 200:
        return edge.engine_refusal(m, False, p.request_id)
    if isinstance(relay, OpenAIStream):
        return response
    if m.status != "ok" or relay.error is not None:
        return errors.openai_error(504 if m.timed_out else 502,
                                   relay.error or m.error or "engine error", "api_error",
                                   headers={"x-request-id": p.request_id})  # fmt: skip
    return web.Response(body=_encoder.encode(relay.answer(p.model, p.request_id)),
                        content_type="application/json",
                        headers={"x-request-id": p.request_id})  # fmt: skip


async def completions(request: web.Request) -> web.StreamResponse:
    return await openai_request(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await openai_request(request, chat=True)


@dataclass(frozen=True)
class TranslatedApi:
    """An API the router translates into a chat completion (Anthropic's Messages, OpenAI's
    Responses): how to decode a body, where its output limit is, which relay answers, and
    the shape of its errors and of its request-id header."""

    anthropic: bool
    decode: Callable[[bytes], tuple[Any, str, bytes, dict[str, Any]]]
    limit_field: str  # the body's output limit (its name, for a 400)
    prompt_param: str
    relay: Callable[[web.Request, web.StreamResponse | None, Any, str, int, Grant, RouterState],
                    Any]  # fmt: skip

    @property
    def id_header(self) -> str:
        return "request-id" if self.anthropic else "x-request-id"


def _anthropic_relay(request: web.Request, response: web.StreamResponse | None, body: Any,
                     rid: str, tokens: int, grant: Grant, state: RouterState) -> Any:  # fmt: skip
    reports = state.reports_cached(grant)
    return anthropic.AnthropicRelay(request, response, f"msg_{rid}", body.model, tokens, reports,
                                    grant.cached_tokens if reports else 0,
                                    anthropic.thinking_on(body.thinking))  # fmt: skip


def _responses_relay(request: web.Request, response: web.StreamResponse | None, body: Any,
                     rid: str, tokens: int, grant: Grant, state: RouterState) -> Any:  # fmt: skip
    return responses_relay.ResponsesRelay(request, response, body, rid, tokens,
                                          state.reports_cached(grant))  # fmt: skip


MESSAGES = TranslatedApi(True, anthropic.decode_messages, "max_tokens", "messages",
                         _anthropic_relay)  # fmt: skip
RESPONSES = TranslatedApi(False, responses.decode_responses, "max_output_tokens", "input",
                          _responses_relay)  # fmt: skip


async def translated_request(request: web.Request, api: TranslatedApi) -> web.StreamResponse:
    """A request of an API the router translates: decoded, tokenized as the chat the engine
    gets, placed, routed, relayed from the engine's chat completion stream and answered in
    the API's own shapes (errors and 429s too)."""
    state = request.app[STATE]
    arrived = time.monotonic()
    if not state.authorized(request):
        return unauthorized(api.anthropic)
    try:
        raw = await edge.read_body(request, state.settings)
        body, text, upstream, chat = await off_loop(state, len(raw), api.decode, raw)
        check_model(state, body.model)
        limit, wanted = state.settings.router.max_output_tokens, getattr(body, api.limit_field)
        if (wanted or 0) > limit:
            raise RequestError(f"{api.limit_field} must be at most {limit} "
                               "(router.max_output_tokens)", param=api.limit_field)  # fmt: skip
        text = await state.tokenizers.chat_text(body.model, text, lambda: chat, len(raw))
        tokens = await tokens_of(state, body.model, text, None, api.prompt_param)
        p = await place(state, request, body, tokens, wanted)
        routed = await route(state, p, api.anthropic)
    except RequestError as exc:
        return refused(state, exc, api.anthropic)
    if isinstance(routed, web.Response):
        return routed
    grant, url, p = routed
    ids: dict[str, str] = {api.id_header: p.request_id}
    response = EventStream(headers={**SSE_HEADERS, **ids}) if body.stream else None
    relay = api.relay(request, response, body, p.request_id, len(tokens), grant, state)
    m = await relay_to_engine(state, request, p, grant, url + "/v1/chat/completions", upstream,
                              relay, arrived)  # fmt: skip
    if m is None:  # the client went away mid-stream
        return response or web.Response(status=499)
    if m.engine_status != 200:
        return edge.engine_refusal(m, api.anthropic, p.request_id)
    if response is not None:
        with contextlib.suppress(ClientGone):  # gone after the last text: nothing to tell
            await relay.finish(m)
        return response
    if m.status != "ok":
        status, message = 504 if m.timed_out else 502, m.error or "engine error"
        if api.anthropic:
            return errors.anthropic_error(status, message, p.request_id, ids)
        return errors.openai_error(status, message, "api_error", headers=ids)
    return web.Response(body=_encoder.encode(relay.answer(m)), content_type="application/json",
                        headers=ids)  # fmt: skip


async def messages(request: web.Request) -> web.StreamResponse:
    return await translated_request(request, MESSAGES)


async def responses_api(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses`` (``responses.py``): errors and 429s in OpenAI's shape."""
    return await translated_request(request, RESPONSES)


async def count_tokens(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.authorized(request):
        return unauthorized(True)
    try:
        raw = await edge.read_body(request, state.settings)
        body, text, chat = await off_loop(state, len(raw), anthropic.decode_count_tokens, raw)
        check_model(state, body.model)
        text = await state.tokenizers.chat_text(body.model, text, lambda: chat, len(raw))
        tokens = await state.tokenizers.encode(body.model, text)
    except RequestError as exc:
        return refused(state, exc, True)
    return web.json_response({"input_tokens": len(tokens)})


def _model(state: RouterState, model_id: str, parent: str | None = None) -> dict[str, Any]:
    # The fields of both SDKs' model objects (OpenAI's Model, Anthropic's ModelInfo).
    # ``root``/``parent`` as vLLM's own /v1/models (``vllm bench serve`` reads ``root``; a
    # LoRA adapter's ``parent`` is its base model); ``max_model_len`` as vLLM's too: the
    # longest context an engine of the model takes, when the engines file gives every one's.
    lengths = [
        e.max_model_len
        for e in state.engines.values()
        if (model_id in e.lora_adapters if parent else e.model == model_id)
    ]
    longest = max(lengths) if lengths and None not in lengths else None  # type: ignore[type-var]
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "foretoken",
            "root": model_id, "parent": parent, "type": "model", "display_name": model_id,
            "created_at": "1970-01-01T00:00:00Z", "max_model_len": longest}  # fmt: skip


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.authorized(request):
        return unauthorized(errors.anthropic_shape(request))
    data = [_model(state, m) for m in state.models]
    data += [_model(state, a, base) for a, base in sorted(state.adapters.items())]
    return web.json_response({"object": "list", "data": data, "has_more": False,
                              "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None})  # fmt: skip


async def model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.authorized(request):
        return unauthorized(errors.anthropic_shape(request))
    model_id = request.match_info["model"]
    if model_id not in state.models and model_id not in state.adapters:
        served = state.models + sorted(state.adapters)
        message = f"unknown model {model_id!r}: not served here; served: {served}"
        return errors.error(errors.anthropic_shape(request), 404, message, param="model",
                            code="model_not_found")  # fmt: skip
    return web.json_response(_model(state, model_id, state.adapters.get(model_id)))


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def healthz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({
        "status": "ok", "pid": os.getpid(), "kafka_connected": state.publisher.connected,
        "buffered": state.publisher.queue.qsize(), "dropped": state.publisher.dropped,
        "published": state.publisher.published, "unencodable": state.publisher.unencodable,
        "failed_sends": state.publisher.failed_sends,
        "missing_topics": state.publisher.missing_topics,
        "route_services": state.routing.client.describe(),
        "engines_down": state.routing.engines_down(),
    })  # fmt: skip


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    text = generate_latest(state.metrics.registry).decode()
    pub = state.publisher
    text += (
        f"foretoken_router_publish_buffered {pub.queue.qsize()}\n"
        f"foretoken_router_publish_dropped_total {pub.dropped}\n"
        f"foretoken_router_published_total {pub.published}\n"
        f"foretoken_router_publish_failed_sends_total {pub.failed_sends}\n"
        f"foretoken_router_kafka_connected {int(pub.connected)}\n"
    )
    return web.Response(text=text, content_type="text/plain")


def make_app(settings: Settings, engines: list[EngineConfig]) -> web.Application:
    cfg = settings.router
    app = web.Application(client_max_size=cfg.max_body_bytes,
                          middlewares=[edge.request_ids, errors.json_http_errors])  # fmt: skip
    tokenizers = Tokenizers.of(engines, cfg.tokenizers, cfg.chat_templates,
                               cfg.tokenize_off_loop_chars)  # fmt: skip
    state = RouterState(settings, {e.worker_id: e for e in engines},
                        Publisher(settings, cfg.publish_buffer), tokenizers=tokenizers)  # fmt: skip
    app[STATE] = state
    if cfg.cors_origins:
        edge.cors(app, cfg.cors_origins)

    async def on_startup(app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0, ttl_dns_cache=300)
        state.engine_session = aiohttp.ClientSession(connector=connector,
                                                     auto_decompress=False)  # fmt: skip
        await state.routing.start()
        await state.publisher.start()
        freeze_startup_heap()  # full collections then walk only what requests leave

    async def on_cleanup(app: web.Application) -> None:
        await state.publisher.stop()
        await state.routing.stop()
        if state.engine_session is not None:
            await state.engine_session.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    routes: list[tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]] = [
        ("POST", "/v1/completions", completions),
        ("POST", "/v1/chat/completions", chat_completions),
        ("POST", "/v1/messages", messages),
        ("POST", "/v1/messages/count_tokens", count_tokens),
        ("POST", "/v1/responses", responses_api),
        ("POST", "/generate", native.generate),  # SGLang's native API
        ("GET", "/v1/models", models),
        ("GET", "/v1/models/{model:.+}", model),  # Hugging Face names hold a slash
        ("GET", "/health", health),
        ("GET", "/healthz", healthz),
        ("GET", "/metrics", metrics),
    ]
    for method, path, handler in routes:
        if method == "GET":
            app.router.add_get(path, handler)  # and HEAD (a load balancer's health probe)
        else:
            app.router.add_route(method, path, handler)
    passthrough.add_routes(app)  # embeddings, scores, tokenize, …: to an engine, untouched
    return app


# The connections' settings. (aiohttp 3.14's run_app hands ``handler_args`` to each
# connection's handler as one unknown keyword, which then drops them all, so the runner
# is built here.) Idle keep-alive connections close after KEEPALIVE_S; the rest of a
# refused body (413, 408) is drained for at most LINGER_S; bodies are never decompressed
# (``read_body`` refuses a Content-Encoding: a 4 MB gzip body inflates to 4 GB).
# A connection that has not sent a whole request head within KEEPALIVE_S is closed too
# (aiohttp ≥ 3.14 arms the keep-alive timer at connect: a half-sent or dribbled head — a
# slowloris — holds a socket for at most that long; tests/unit/adapters/http/test_head_timeout.py).
KEEPALIVE_S = 75.0
LINGER_S = 1.0


def make_runner(app: web.Application) -> web.AppRunner:
    # handler_cancellation: a client that goes away cancels its handler, so the engine's
    # request is closed too (vLLM and SGLang abort it) and counted cancelled. Without it
    # (aiohttp's default) a non-streaming request ran to its end on the engine for nobody:
    # only a streaming one noticed, at its next write.
    return web.AppRunner(app, access_log=None, keepalive_timeout=KEEPALIVE_S,
                         lingering_time=LINGER_S, auto_decompress=False,
                         handler_cancellation=True)  # fmt: skip


async def _serve_until_signal(app: web.Application, host: str, port: int,
                              reuse_port: bool) -> None:  # fmt: skip
    runner = make_runner(app)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await web.TCPSite(runner, host, port, reuse_port=reuse_port or None).start()
        await stop.wait()
    finally:
        await runner.cleanup()  # the app's shutdown hooks: the publisher drains


def _serve(settings: Settings, engines: list[EngineConfig], host: str, port: int,
           reuse_port: bool) -> None:  # fmt: skip
    import uvloop

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(
            _serve_until_signal(make_app(settings, engines), host, port, reuse_port)
        )
    finally:
        loop.close()


def run_router(settings: Settings, engines: list[EngineConfig], host: str, port: int) -> None:
    """Serve on ``host:port``; with ``router.processes`` > 1, that many processes share the
    port (SO_REUSEPORT: the kernel spreads connections) and this one waits for them."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("aiohttp.server").addFilter(errors.ClientFaults())
    n = settings.router.processes
    taken = port_taken(host, port) if n == 1 else None
    if taken is not None:
        print(f"error: the router {taken} (--port, router.port)", file=sys.stderr)
        raise SystemExit(1)
    if n == 1:
        _serve(settings, engines, host, port, reuse_port=False)
        return
    children: list[int] = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:  # the child: nothing of the parent's loop or threads exists yet
            try:
                _serve(settings, engines, host, port, reuse_port=True)
            finally:
                os._exit(0)
        children.append(pid)

    def stop(signum: int, frame: Any) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for child in children:
        while True:
            try:
                os.waitpid(child, 0)
                break
            except ChildProcessError:
                break
            except InterruptedError:
                continue
