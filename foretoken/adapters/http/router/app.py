"""The thin router in front of the engines: ``foretoken router``.

OpenAI (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models[/{id}]``) and Anthropic
(``/v1/messages``, ``/v1/messages/count_tokens``) surfaces; ``/health``, ``/healthz``,
``/metrics``. Per request: read the body (size limit, read timeout), decode it once into
typed structs (``requests.py``, ``anthropic.py``; big bodies in a thread), tokenize (long
texts in a thread), ask the route service (``routing.py``) — or, when it is slow or down,
decide alone — then either answer 429 at once (``errors.py``) or forward to the chosen engine
and relay its answer (``proxy.py``). Grants and outcomes go to Kafka through a bounded
buffer, never on the request path. uvloop; several processes on one port when
``router.processes`` > 1 (SO_REUSEPORT).

aiohttp rather than FastAPI: the router is a byte-level streaming proxy; aiohttp gives the
client session and the server in one small dependency that the processor (Faust) already uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from foretoken.adapters.engines.engines_file import EngineConfig
from foretoken.adapters.heap import freeze_startup_heap
from foretoken.adapters.http.router import anthropic, edge, errors
from foretoken.adapters.http.router.proxy import (
    ClientGone,
    Collected,
    Measured,
    OpenAIStream,
    Relay,
    forward,
)
from foretoken.adapters.http.router.publisher import Publisher
from foretoken.adapters.http.router.requests import RequestError, decode_openai
from foretoken.adapters.http.router.routing import Placement, Routing, is_text, options
from foretoken.adapters.http.tokenizers import Tokenizers
from foretoken.adapters.processes import port_taken
from foretoken.core.types import ModelName, RejectReason, WorkerId
from foretoken.settings import Settings
from foretoken.wire.records import Grant, Outcome

log = logging.getLogger(__name__)
STATE: web.AppKey[RouterState] = web.AppKey("state")
LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
OUTCOMES = ("ok", "error", "cancelled", "rejected", "too_large", "bad_request")


class EventStream(web.StreamResponse):
    """A streamed answer whose headers go out with its first bytes (one write, not two)."""

    _send_headers_immediately = False


_encoder = msgspec.json.Encoder()


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "foretoken_router_requests", "Requests by outcome.", ["outcome"], registry=self.registry
        )
        self.outcome = {name: self.requests.labels(name) for name in OUTCOMES}
        self.fallbacks = Counter(
            "foretoken_router_fallbacks", "Decisions made without the route service.",
            ["reason"], registry=self.registry,
        )  # fmt: skip
        self.added = Histogram(
            "foretoken_router_added_seconds", "Router time before the engine is called.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip


@dataclass
class RouterState:
    settings: Settings
    engines: dict[str, EngineConfig]
    publisher: Publisher
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    tokenizers: Tokenizers = field(default_factory=Tokenizers)
    engine_session: aiohttp.ClientSession | None = None

    def __post_init__(self) -> None:
        cfg = self.settings.router
        fallbacks = self.metrics.fallbacks
        self.routing = Routing(
            self.settings, self.engines, on_fallback=lambda r: fallbacks.labels(r).inc()
        )
        self.models = sorted({e.model for e in self.engines.values()})
        self.keys = edge.api_keys(self.settings)
        self.forward_headers = tuple(h.lower() for h in cfg.forward_headers)
        # An idle timeout, not a total one: a healthy stream (a long answer) is never cut;
        # an engine silent for engine_timeout_s (before its first token, or mid-stream) is.
        self.engine_timeout = aiohttp.ClientTimeout(total=None, connect=cfg.engine_timeout_s,
                                                    sock_read=cfg.engine_timeout_s)  # fmt: skip

    def authorized(self, request: web.Request) -> bool:
        if not self.keys:
            return True
        # Either header may hold the key (the Anthropic SDK sends x-api-key, the OpenAI SDK
        # a bearer token); a client may send both, one of them meant for the engine.
        offered = [request.headers.get("x-api-key") or ""]
        auth = request.headers.get("authorization") or ""
        if auth[:7].lower() == "bearer ":
            offered.append(auth[7:].strip())
        given = [o.encode(errors="surrogateescape") for o in offered if o]  # raw bytes
        return any(hmac.compare_digest(g, key) for g in given for key in self.keys)

    def reports_cached(self, grant: Grant) -> bool:
        """Whether the granted engine reports cached tokens (then an omitted count is 0)."""
        engine = self.engines.get(grant.worker_id) if grant.worker_id is not None else None
        return engine is not None and engine.reports_cached_tokens

    def upstream_headers(self, request: web.Request, request_id: str,
                         engine: EngineConfig | None = None) -> dict[str, str]:  # fmt: skip
        out = {"Content-Type": "application/json"}
        for name in self.forward_headers:
            value = request.headers.get(name)
            if value is not None and is_text(value):
                out[name] = value  # (bytes that are not text are not passed on)
        out.setdefault("x-request-id", request_id)
        if engine is not None and not engine.request_id_header:
            for name in [k for k in out if k.lower() == "x-request-id"]:
                del out[name]
        return out


# ---------------------------------------------------------------------- the request path


async def off_loop(state: RouterState, size: int, fn: Callable[..., Any], *args: Any) -> Any:
    if size >= state.settings.router.decode_off_loop_bytes:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def tokens_of(state: RouterState, model: str, text: str | None, ids: np.ndarray | None,
                    param: str, special: bool = False) -> np.ndarray:  # fmt: skip
    limit = state.settings.router.max_prompt_tokens
    tokens = (ids if ids is not None
              else await state.tokenizers.encode(model, text or "", limit, special))  # fmt: skip
    if len(tokens) == 0:
        raise RequestError(f"{param} has no tokens (empty or whitespace only)", param=param)
    if len(tokens) > limit:
        raise RequestError(f"the prompt has more than {limit} tokens, more than this router "
                           "takes (router.max_prompt_tokens)", param=param,
                           code="context_length_exceeded")  # fmt: skip
    return tokens


def check_model(state: RouterState, model: str) -> None:
    if model not in state.models:
        raise RequestError(f"unknown model {model!r}; served: {state.models}", status=404,
                           param="model", code="model_not_found")  # fmt: skip


async def place(state: RouterState, request: web.Request, body: Any, tokens: np.ndarray,
                expected_output: int | None) -> Placement:  # fmt: skip
    opts = options(state.settings, body, request.headers)
    request_id, waited = state.routing.attempt(opts.client_id, opts.already_waited_s)
    return Placement(
        request_id=request_id, client_id=opts.client_id, model=ModelName(body.model),
        token_ids=tokens, max_queue_wait_s=opts.max_queue_wait_s, already_waited_s=waited,
        workload_class=opts.workload_class, prefer_cache_hit=opts.prefer_cache_hit,
        conversation_id=opts.conversation_id, expected_output_tokens=expected_output,
    )  # fmt: skip


async def route(state: RouterState, p: Placement, anthropic_shape: bool
                ) -> tuple[Grant, str, Placement] | web.Response:  # fmt: skip
    """The grant, the engine's URL and the placement under the grant's request id (a fresh
    one when the route service knew the first for another request), or the answer that
    turns the request away."""
    grant, url = await state.routing.decide(p)
    if grant.request_id != p.request_id:
        p = dataclasses.replace(p, request_id=grant.request_id)
    state.publisher.put("grants", grant)
    if grant.reject_reason == RejectReason.PROMPT_EXCEEDS_KV_CAPACITY:
        state.metrics.outcome["too_large"].inc()
        return errors.error(anthropic_shape, 400,
                            f"the prompt ({len(p.token_ids)} tokens) exceeds the KV capacity of "
                            "every worker of this model", code="context_length_exceeded",
                            request_id=p.request_id)  # fmt: skip
    if not grant.admitted or url is None or grant.worker_id is None:
        state.metrics.outcome["rejected"].inc()
        state.routing.rejected(p.client_id)
        return errors.rejection(grant, anthropic_shape)
    state.routing.admitted(p.client_id)
    return grant, url, p


async def relay_to_engine(
    state: RouterState, request: web.Request, p: Placement, grant: Grant, url: str,
    body: bytes, relay: Relay, arrived: float,
) -> Measured | None:  # fmt: skip
    """Forward, relay, publish the outcomes; None when the client went away."""
    worker = grant.worker_id
    assert worker is not None
    engine = state.engines.get(worker)
    n = len(p.token_ids)
    state.routing.sent(worker, n)
    state.metrics.added.observe(time.monotonic() - arrived)

    def first_token(at: float) -> None:
        state.publisher.put("outcomes", Outcome(
            request_id=p.request_id, ts=time.time(), kind="first_token", worker_id=worker,
            actual_ttft_s=at - arrived + p.already_waited_s,
        ))  # fmt: skip

    assert state.engine_session is not None
    try:
        measured = await forward(state.engine_session, url, body,
                                 state.upstream_headers(request, p.request_id, engine), relay,
                                 first_token, state.engine_timeout)  # fmt: skip
    except ClientGone:
        publish_completion(state, p, worker, engine, arrived, None, "cancelled", "client went away")
        state.metrics.outcome["cancelled"].inc()
        return None
    except asyncio.CancelledError:
        publish_completion(state, p, worker, engine, arrived, None, "cancelled", "client went away")
        state.metrics.outcome["cancelled"].inc()
        raise
    finally:
        state.routing.sent(worker, -n)
    publish_completion(state, p, worker, engine, arrived, measured, measured.status,
                       measured.error)  # fmt: skip
    state.metrics.outcome[measured.status].inc()
    return measured


def publish_completion(
    state: RouterState, p: Placement, worker: WorkerId, engine: EngineConfig | None,
    arrived: float, m: Measured | None, status: str, error: str | None,
) -> None:  # fmt: skip
    cached = ttft = out_tokens = step_s = None
    if m is not None:
        step_s = m.decode_step_s if status == "ok" else None
        cached = m.cached_tokens
        if cached is None and m.usage_seen and engine is not None and engine.reports_cached_tokens:
            cached = 0  # the field is omitted on a miss
        if m.first_token_s is not None:
            ttft = m.first_token_s - arrived + p.already_waited_s
        out_tokens = m.output_tokens
    state.publisher.put("outcomes", Outcome(
        request_id=p.request_id, ts=time.time(), kind="completion", worker_id=worker,
        status=status, actual_ttft_s=ttft, engine_cached_tokens=cached,  # type: ignore[arg-type]
        output_tokens=out_tokens, e2e_s=time.monotonic() - arrived, error=error,
        decode_step_s=step_s,
    ))  # fmt: skip


def refused(state: RouterState, exc: RequestError, anthropic_shape: bool) -> web.Response:
    state.metrics.outcome["bad_request"].inc()
    resp = errors.error(anthropic_shape, exc.status, exc.message, kind=exc.kind, code=exc.code,
                        param=exc.param)  # fmt: skip
    if exc.status in (408, 413):
        resp.force_close()  # the rest of the body is never read
    return resp


def unauthorized(anthropic_shape: bool) -> web.Response:
    return errors.error(anthropic_shape, 401, "a valid API key is required (Authorization: "
                        "Bearer KEY or x-api-key)", kind="authentication_error",
                        code="invalid_api_key")  # fmt: skip


# ---------------------------------------------------------------------- handlers


async def openai_request(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    arrived = time.monotonic()
    if not state.authorized(request):
        return unauthorized(False)
    try:
        raw = await edge.read_body(request, state.settings)
        d = await off_loop(state, len(raw), decode_openai, raw, chat,
                           state.settings.router.max_output_tokens)  # fmt: skip
        check_model(state, d.body.model)
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


async def messages(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrived = time.monotonic()
    if not state.authorized(request):
        return unauthorized(True)
    try:
        raw = await edge.read_body(request, state.settings)
        body, text, upstream, chat = await off_loop(state, len(raw), anthropic.decode_messages,
                                                    raw)  # fmt: skip
        check_model(state, body.model)
        text = await state.tokenizers.chat_text(body.model, text, lambda: chat, len(raw))
        limit = state.settings.router.max_output_tokens
        if body.max_tokens > limit:
            raise RequestError(f"max_tokens must be at most {limit} (router.max_output_tokens)",
                               param="max_tokens")  # fmt: skip
        tokens = await tokens_of(state, body.model, text, None, "messages")
        p = await place(state, request, body, tokens, body.max_tokens)
        routed = await route(state, p, True)
    except RequestError as exc:
        return refused(state, exc, True)
    if isinstance(routed, web.Response):
        return routed
    grant, url, p = routed
    response = (EventStream(headers={**SSE_HEADERS, "request-id": p.request_id})
                if body.stream else None)  # fmt: skip
    reports = state.reports_cached(grant)
    relay = anthropic.AnthropicRelay(request, response, f"msg_{p.request_id}", body.model,
                                     len(tokens), reports,
                                     grant.cached_tokens if reports else 0)  # fmt: skip
    m = await relay_to_engine(state, request, p, grant, url + "/v1/chat/completions", upstream,
                              relay, arrived)  # fmt: skip
    if m is None:  # the client went away mid-stream
        return response or web.Response(status=499)
    if m.engine_status != 200:
        return edge.engine_refusal(m, True, p.request_id)
    if response is not None:
        with contextlib.suppress(ClientGone):  # gone after the last text: nothing to tell
            await relay.finish(m)
        return response
    if m.status != "ok":
        return errors.anthropic_error(504 if m.timed_out else 502, m.error or "engine error",
                                      p.request_id, {"request-id": p.request_id})  # fmt: skip
    return web.Response(body=_encoder.encode(relay.answer(m)), content_type="application/json",
                        headers={"request-id": p.request_id})  # fmt: skip


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


def _model(model_id: str) -> dict[str, Any]:
    # The fields of both SDKs' model objects (OpenAI's Model, Anthropic's ModelInfo).
    # ``root``/``parent`` as vLLM's own /v1/models (``vllm bench serve`` reads ``root``).
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "foretoken",
            "root": model_id, "parent": None, "type": "model", "display_name": model_id,
            "created_at": "1970-01-01T00:00:00Z"}  # fmt: skip


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.authorized(request):
        return unauthorized(errors.anthropic_shape(request))
    data = [_model(m) for m in state.models]
    return web.json_response({"object": "list", "data": data, "has_more": False,
                              "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None})  # fmt: skip


async def model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.authorized(request):
        return unauthorized(errors.anthropic_shape(request))
    model_id = request.match_info["model"]
    if model_id not in state.models:
        message = f"unknown model {model_id!r}: not served here; served: {state.models}"
        return errors.error(errors.anthropic_shape(request), 404, message, param="model",
                            code="model_not_found")  # fmt: skip
    return web.json_response(_model(model_id))


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def healthz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({
        "status": "ok", "pid": os.getpid(), "kafka_connected": state.publisher.connected,
        "buffered": state.publisher.queue.qsize(), "dropped": state.publisher.dropped,
        "published": state.publisher.published, "unencodable": state.publisher.unencodable,
        "missing_topics": state.publisher.missing_topics,
        "route_services": state.routing.client.describe(),
    })  # fmt: skip


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    text = generate_latest(state.metrics.registry).decode()
    pub = state.publisher
    text += (
        f"foretoken_router_publish_buffered {pub.queue.qsize()}\n"
        f"foretoken_router_publish_dropped_total {pub.dropped}\n"
        f"foretoken_router_published_total {pub.published}\n"
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
