"""The thin OpenAI-compatible router: ``foretoken router``.

Per request: validate, tokenize, ask the route service (``POST /v1/route`` on the Faust
worker) — or, when it is slow or down, decide alone with the fallback policy — then either
answer 429 at once with ``Retry-After``/``retry-after-ms``, or forward to the chosen engine
and stream its answer back. The router always streams from the engine (adding
``include_usage``) so that it measures the time to the first content token even when the
client asked for one JSON answer. Grants and outcomes go to Kafka through a bounded buffer,
never on the request path.

aiohttp rather than FastAPI: the router is a byte-level streaming proxy; aiohttp gives the
client session and the server in one small dependency that the worker (Faust) already uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from foretoken.adapters.engines.engines_file import EngineConfig
from foretoken.adapters.http.route_page import TOKEN_HEADER
from foretoken.adapters.http.router.publisher import Publisher
from foretoken.adapters.http.tokenizers import Tokenizers
from foretoken.core.routing.decide import decision
from foretoken.core.routing.fallback import Load, least_outstanding
from foretoken.core.tokenizer import chat_to_text
from foretoken.core.types import ModelName, RejectReason, RequestId, RouteQuery, WorkerId
from foretoken.settings import Settings
from foretoken.wire.records import Grant, Outcome, as_record
from foretoken.wire.route_rpc import RouteRequest, RouteResponse, pack_token_ids

log = logging.getLogger(__name__)
STATE: web.AppKey[RouterState] = web.AppKey("state")
NO_RETRY_AFTER_S = 300.0
ATTEMPT_MEMORY = 100_000
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class BadRequest(ValueError):
    pass


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "foretoken_router_requests", "Requests by outcome.", ["outcome"], registry=self.registry
        )
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
    # Prompt tokens and requests sent to each engine and not yet answered (the fallback).
    outstanding: dict[str, Load] = field(default_factory=dict)
    session: aiohttp.ClientSession | None = None
    # After a route-service failure, decide alone until then (monotonic s): a circuit breaker
    # so that an overloaded route service is not asked again and again at full timeout.
    route_down_until: float = 0.0
    # Client request ids answered 429: (first seen, attempts). A retry is a new attempt with
    # its own grant (``<id>~<n>``), and the time since the first try counts as waited.
    attempts: OrderedDict[str, tuple[float, int]] = field(default_factory=OrderedDict)

    def attempt(self, client_id: str | None, waited_s: float) -> tuple[str, float]:
        if client_id is None:
            return uuid.uuid4().hex, waited_s
        seen = self.attempts.get(client_id)
        if seen is None:
            return client_id, waited_s
        first, n = seen
        self.attempts[client_id] = (first, n + 1)
        return f"{client_id}~{n + 1}", max(waited_s, time.monotonic() - first)

    def rejected(self, client_id: str | None) -> None:
        if client_id is None or client_id in self.attempts:
            return
        self.attempts[client_id] = (time.monotonic(), 1)
        if len(self.attempts) > ATTEMPT_MEMORY:
            self.attempts.popitem(last=False)

    def load_of(self, worker: str) -> Load:
        return self.outstanding.get(worker, Load())

    def sent(self, worker: str, prompt_tokens: int) -> None:
        """A request sent to ``worker`` (a negative count: it was answered)."""
        load = self.load_of(worker)
        requests = load.requests + (1 if prompt_tokens >= 0 else -1)
        self.outstanding[worker] = Load(max(0, load.prompt_tokens + prompt_tokens),
                                        max(0, requests))  # fmt: skip

    def models(self) -> set[str]:
        return {e.model for e in self.engines.values()}


# ---------------------------------------------------------------------- request parsing


@dataclass(frozen=True, slots=True)
class Parsed:
    request_id: RequestId
    client_id: str | None
    model: ModelName
    body: dict[str, Any]
    token_ids: list[int]
    stream: bool
    chat: bool
    max_queue_wait_s: float | None
    already_waited_s: float
    workload_class: str
    prefer_cache_hit: bool
    conversation_id: str | None

    @property
    def expected_output_tokens(self) -> int | None:
        value = self.body.get("max_tokens") or self.body.get("max_completion_tokens")
        return int(value) if isinstance(value, int) and value > 0 else None

    def query(self) -> RouteQuery:
        """The core's view of the request (for decisions the router makes itself)."""
        return RouteQuery(
            request_id=self.request_id, model=self.model, tokens=self.token_ids,
            prompt_tokens=len(self.token_ids), max_queue_wait_s=self.max_queue_wait_s,
            already_waited_s=self.already_waited_s, workload_class=self.workload_class,
            prefer_cache_hit=self.prefer_cache_hit, conversation_id=self.conversation_id,
            expected_output_tokens=self.expected_output_tokens,
        )  # fmt: skip


def _float_or_none(value: Any, name: str) -> float | None:
    if value is None or value == "":
        return None
    try:
        out = float(value)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"{name} must be a number") from exc
    if not math.isfinite(out):
        raise BadRequest(f"{name} must be finite")
    return out


def parse(state: RouterState, request: web.Request, raw: bytes, chat: bool) -> Parsed:
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc.msg}") from exc
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    model = body.get("model")
    if model not in state.models():
        raise BadRequest(f"unknown model {model!r}; served: {sorted(state.models())}")
    cfg = state.settings.router
    klass = body.pop("workload_class", None) or request.headers.get("x-workload-class")
    classes = state.settings.controls.classes
    if klass is not None and str(klass) not in classes:
        raise BadRequest(f"unknown workload class {klass!r}; configured: {sorted(classes)}")
    class_name, workload = state.settings.controls.workload_class(klass and str(klass))
    bound = _float_or_none(
        body.pop("max_queue_wait_s", None) or request.headers.get("x-max-queue-wait-s"),
        "max_queue_wait_s",
    )
    if bound is not None and not cfg.min_queue_wait_s <= bound <= cfg.max_queue_wait_s:
        raise BadRequest(
            f"max_queue_wait_s must be within {cfg.min_queue_wait_s}–{cfg.max_queue_wait_s} s"
        )
    if bound is None and workload.max_queue_wait_s is not None:
        # the class's default bound, kept within the range a client may ask for: a request
        # that names no bound is never refused for one it did not send
        default = workload.max_queue_wait_s
        bound = min(max(default, cfg.min_queue_wait_s), cfg.max_queue_wait_s)
    waited = _float_or_none(
        body.pop("already_waited_s", None) or request.headers.get("x-already-waited-s"),
        "already_waited_s",
    )
    prefer = body.pop("prefer_cache_hit", None)
    if prefer is None:
        prefer = request.headers.get("x-prefer-cache-hit", "").lower() in ("1", "true", "yes")
    conversation = body.pop("conversation_id", None) or request.headers.get("x-conversation-id")
    client_id = request.headers.get("x-request-id")
    request_id, waited_s = state.attempt(client_id, max(0.0, waited or 0.0))
    return Parsed(
        request_id=RequestId(request_id),
        client_id=client_id,
        model=ModelName(model),
        body=body,
        token_ids=_tokens(state, body, chat),
        stream=bool(body.get("stream")),
        chat=chat,
        max_queue_wait_s=bound,
        already_waited_s=waited_s,
        workload_class=class_name,
        prefer_cache_hit=bool(prefer),
        conversation_id=str(conversation) if conversation else None,
    )


def _tokens(state: RouterState, body: dict[str, Any], chat: bool) -> list[int]:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        return state.tokenizers.for_model(body["model"]).encode(chat_to_text(messages))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        if not all(0 <= t < 1 << 32 for t in prompt):
            raise BadRequest("token ids must be integers in [0, 2**32)")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return state.tokenizers.for_model(body["model"]).encode(prompt)
    raise BadRequest("prompt must be a non-empty string or a list of token ids")


# ---------------------------------------------------------------------- errors


def error_response(status: int, message: str, kind: str, code: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:  # fmt: skip
    """An error body the official openai client parses (``error.type/code/message``)."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def too_many(grant: Grant) -> web.Response:
    """429 with Retry-After; when waiting cannot help (no ``retry_after_s`` in the grant),
    ``x-should-retry: false`` tells the openai and anthropic clients not to retry."""
    never = grant.retry_after_s is None
    retry_s = max(grant.retry_after_s or NO_RETRY_AFTER_S, 0.001)
    headers = {
        "Retry-After": str(max(1, math.ceil(retry_s))),
        "retry-after-ms": str(max(1, round(retry_s * 1000))),
    }
    if never:
        headers["x-should-retry"] = "false"
    message = (
        f"request {grant.request_id} cannot meet its time-to-first-token bound "
        f"({grant.reject_reason}); retry after {retry_s:.2f} s"
    )
    return error_response(429, message, "rate_limit_exceeded", "ttft_bound_exceeded", headers)


# ---------------------------------------------------------------------- routing


async def decide(state: RouterState, p: Parsed) -> tuple[Grant, str | None]:
    route = RouteRequest(
        request_id=p.request_id, model=p.model, packed_token_ids=pack_token_ids(p.token_ids),
        prompt_tokens=len(p.token_ids), max_queue_wait_s=p.max_queue_wait_s,
        already_waited_s=p.already_waited_s, workload_class=p.workload_class,
        prefer_cache_hit=p.prefer_cache_hit, conversation_id=p.conversation_id,
        expected_output_tokens=p.expected_output_tokens,
    )  # fmt: skip
    assert state.session is not None
    cfg = state.settings.router
    if time.monotonic() < state.route_down_until:
        state.metrics.fallbacks.labels("circuit_open").inc()
        return fallback(state, p)
    reason = "error"
    try:
        async with state.session.post(
            f"{state.settings.route_url}/v1/route",
            data=msgspec.msgpack.encode(route),
            headers=route_headers(state.settings),
            timeout=aiohttp.ClientTimeout(total=cfg.route_timeout_s),
        ) as resp:
            if resp.status == 200:
                decided = msgspec.json.decode(await resp.read(), type=RouteResponse)
                return decided.grant, decided.http_url
            reason = f"http_{resp.status}"
    except TimeoutError:
        reason = "timeout"
    except (aiohttp.ClientError, msgspec.DecodeError, msgspec.ValidationError):
        reason = "unavailable"
    state.metrics.fallbacks.labels(reason).inc()
    state.route_down_until = time.monotonic() + cfg.route_retry_after_failure_s
    return fallback(state, p)


def route_headers(settings: Settings) -> dict[str, str]:
    """The route call's headers: msgpack, and the route service's token when one is set."""
    headers = {"Content-Type": "application/msgpack"}
    if settings.route.token:
        headers[TOKEN_HEADER] = settings.route.token
    return headers


def fallback(state: RouterState, p: Parsed) -> tuple[Grant, str | None]:
    """Least outstanding prompt tokens among the model's workers that can take the prompt
    (KV capacity ``gpu_blocks × block_size`` and context ``max_model_len``, as registered:
    the documented policy, :func:`foretoken.core.routing.fallback.least_outstanding`); a
    400 when none can hold it, a 429 only when every one is past ``fallback_overload_tokens``."""
    cfg = state.settings.router
    n = len(p.token_ids)
    candidates = [w for w, e in state.engines.items() if e.model == p.model]

    def can_serve(w: str) -> bool:
        return state.engines[w].fits_prompt(n)

    worker = least_outstanding(candidates, state.load_of, can_serve=can_serve,
                               overload_tokens=cfg.fallback_overload_tokens)  # fmt: skip
    query = p.query()
    if worker is None:
        too_big = bool(candidates) and not any(map(can_serve, candidates))
        reason = RejectReason.PROMPT_EXCEEDS_KV_CAPACITY if too_big else RejectReason.OVERLOADED
        rejected = decision(query, time.time(), None, admitted=False, reason=reason,
                            retry_after_s=None if too_big else cfg.fallback_retry_after_s,
                            fallback=True)  # fmt: skip
        return as_record(Grant, rejected), None
    admitted = decision(query, time.time(), None, admitted=True, reason=None,
                        retry_after_s=None, fallback=True, worker_id=WorkerId(worker))  # fmt: skip
    return as_record(Grant, admitted), state.engines[worker].http_url


# ---------------------------------------------------------------------- handlers


async def complete(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    arrived = time.monotonic()
    raw = await request.read()
    try:
        p = parse(state, request, raw, chat)
    except BadRequest as exc:
        state.metrics.requests.labels("bad_request").inc()
        return error_response(400, str(exc), "invalid_request_error")
    grant, url = await decide(state, p)
    state.publisher.put("grants", grant)
    if grant.reject_reason == "prompt_exceeds_kv_capacity":
        state.metrics.requests.labels("too_large").inc()
        return error_response(400, f"the prompt ({len(p.token_ids)} tokens) exceeds the KV "
                              "capacity of every worker of this model",
                              "invalid_request_error", "context_length_exceeded")  # fmt: skip
    if not grant.admitted or url is None or grant.worker_id is None:
        state.metrics.requests.labels("rejected").inc()
        state.rejected(p.client_id)
        return too_many(grant)
    if p.client_id is not None:
        state.attempts.pop(p.client_id, None)
    worker = grant.worker_id
    engine = state.engines.get(worker)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    state.sent(worker, len(p.token_ids))
    state.metrics.added.observe(time.monotonic() - arrived)
    client: web.StreamResponse | None = None
    if p.stream:
        client = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                             "x-request-id": p.request_id})  # fmt: skip
        await client.prepare(request)

    def first_token(at: float) -> None:
        state.publisher.put("outcomes", Outcome(
            request_id=p.request_id, ts=time.time(), kind="first_token", worker_id=worker,
            actual_ttft_s=at - arrived + p.already_waited_s,
        ))  # fmt: skip

    status, error = "ok", None
    try:
        from foretoken.adapters.http.router.proxy import assembled, forward

        measured = await forward(state.session, url + path, p.body, client, first_token,  # type: ignore[arg-type]
                                 state.settings.router.engine_timeout_s)  # fmt: skip
        if measured.status != "ok":
            status, error = "error", measured.error
    except (aiohttp.ClientError, TimeoutError) as exc:
        measured, status, error = None, "error", f"engine unreachable: {exc}"
    except (ConnectionResetError, asyncio.CancelledError):
        measured, status, error = None, "cancelled", "client went away"
        _complete_outcome(state, p, worker, engine, arrived, None, status, error)
        raise
    finally:
        state.sent(worker, -len(p.token_ids))
    _complete_outcome(state, p, worker, engine, arrived, measured, status, error)
    state.metrics.requests.labels(status).inc()
    if client is not None:
        with contextlib.suppress(ConnectionResetError):  # the client left after [DONE]
            await client.write_eof()
        return client
    if measured is None or status != "ok":
        code = measured.engine_status if measured is not None else 502
        return error_response(code if code >= 400 else 502, error or "engine error", "api_error")
    return web.json_response(assembled(measured, p.model, p.request_id, chat),
                             headers={"x-request-id": p.request_id})  # fmt: skip


def _complete_outcome(
    state: RouterState, p: Parsed, worker: WorkerId, engine: EngineConfig | None,
    arrived: float, measured: Any, status: str, error: str | None,
) -> None:  # fmt: skip
    cached: int | None = None
    ttft: float | None = None
    out_tokens = None
    if measured is not None:
        cached = measured.cached_tokens
        if cached is None and engine is not None and engine.reports_cached_tokens:
            cached = 0  # the field is omitted on a miss
        if measured.first_token_s is not None:
            ttft = measured.first_token_s - arrived + p.already_waited_s
        out_tokens = measured.output_tokens
    state.publisher.put("outcomes", Outcome(
        request_id=p.request_id, ts=time.time(), kind="completion", worker_id=worker,
        status=status, actual_ttft_s=ttft, engine_cached_tokens=cached,  # type: ignore[arg-type]
        output_tokens=out_tokens, e2e_s=time.monotonic() - arrived, error=error,
    ))  # fmt: skip


async def completions(request: web.Request) -> web.StreamResponse:
    return await complete(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await complete(request, chat=True)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data = [{"id": m, "object": "model", "owned_by": "foretoken"} for m in sorted(state.models())]
    return web.json_response({"object": "list", "data": data})


async def healthz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({
        "status": "ok", "kafka_connected": state.publisher.connected,
        "buffered": state.publisher.queue.qsize(), "dropped": state.publisher.dropped,
        "published": state.publisher.published,
        "missing_topics": state.publisher.missing_topics,
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


def _tokenizer_paths(settings: Settings, engines: list[EngineConfig]) -> dict[str, str]:
    """Model → tokenizer.json: the engines file's, overridden by the settings'."""
    return {e.model: e.tokenizer for e in engines if e.tokenizer} | settings.router.tokenizers


def make_app(settings: Settings, engines: list[EngineConfig]) -> web.Application:
    app = web.Application(client_max_size=settings.router.max_body_bytes)
    state = RouterState(settings, {e.worker_id: e for e in engines},
                        Publisher(settings, settings.router.publish_buffer),
                        tokenizers=Tokenizers(_tokenizer_paths(settings, engines)))  # fmt: skip
    app[STATE] = state

    async def on_startup(app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        state.session = aiohttp.ClientSession(connector=connector)
        await state.publisher.start()

    async def on_cleanup(app: web.Application) -> None:
        await state.publisher.stop()
        if state.session is not None:
            await state.session.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app


def run_router(settings: Settings, engines: list[EngineConfig], host: str, port: int) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    web.run_app(make_app(settings, engines), host=host, port=port, access_log=None,
                print=None)  # fmt: skip
