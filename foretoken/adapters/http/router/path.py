"""The router's state and its request path, shared by every API's handlers (``app.py``):
the state of one router process (engines, connections, publisher, metrics, tokenizers),
then the steps of a request — decode off the loop when big, tokenize, check the model,
place (foretoken's options and ids), route (the route service, or the fallback; a 429 in
the caller's shape), relay to the engine with its measurement, publish the outcomes."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram

from foretoken.adapters.engines.engines_file import EngineConfig
from foretoken.adapters.http.router import edge, errors
from foretoken.adapters.http.router.proxy import ClientGone, Measured, Relay, forward
from foretoken.adapters.http.router.publisher import Publisher
from foretoken.adapters.http.router.requests import RequestError
from foretoken.adapters.http.router.routing import Placement, Routing, is_text, options
from foretoken.adapters.http.tokenizers import Tokenizers
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
        # LoRA adapter → its base model (a client names the adapter as its model)
        self.adapters = {a: e.model for e in self.engines.values() for a in e.lora_adapters}
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
        # identity: the router reads the engine's bytes (the session never inflates them)
        out = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        for name in self.forward_headers:
            value = request.headers.get(name)
            if value is not None and is_text(value) and name != "x-request-id":
                out[name] = value  # (bytes that are not text are not passed on)
        # The router's own id, never the client's (even when forward_headers names it): an
        # engine that takes the header as its request id (vLLM --enable-request-id-headers)
        # sees one id per attempt — a client's fixed id on concurrent requests would be one
        # id twice — and it is the id of this request's grant, outcomes and answer.
        if engine is None or engine.request_id_header:
            out["x-request-id"] = request_id
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
    if model not in state.models and model not in state.adapters:
        served = state.models + sorted(state.adapters)
        raise RequestError(f"unknown model {model!r}; served: {served}", status=404,
                           param="model", code="model_not_found")  # fmt: skip


async def place(state: RouterState, request: web.Request, body: Any, tokens: np.ndarray,
                expected_output: int | None) -> Placement:  # fmt: skip
    opts = options(state.settings, body, request.headers)
    request_id, waited = state.routing.attempt(opts.client_id, opts.already_waited_s)
    base = state.adapters.get(body.model)  # a LoRA adapter: routed among its base's engines
    return Placement(
        request_id=request_id, client_id=opts.client_id, model=ModelName(base or body.model),
        lora_name=body.model if base is not None else None,
        token_ids=tokens, max_queue_wait_s=opts.max_queue_wait_s, already_waited_s=waited,
        workload_class=opts.workload_class, prefer_cache_hit=opts.prefer_cache_hit,
        conversation_id=opts.conversation_id, expected_output_tokens=expected_output,
        cache_salt=getattr(body, "cache_salt", None) or None,
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
    if measured.engine_status == 0:  # no answer at all: no more requests there for a while
        state.routing.unreachable(worker)
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
