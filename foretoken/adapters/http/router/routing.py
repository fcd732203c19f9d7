"""Placing a request: the route RPC to the route service, and the router's own decision when
that service is slow or down.

The route RPC (``POST /v1/route``, msgpack) carries the prompt as packed unsigned 32-bit token
ids, 4 bytes a token: the router refuses prompts over ``router.max_prompt_tokens``, which the
settings hold under ``router.max_body_bytes`` / 4, so the route call of an accepted request is
never larger than the body limit the router and the route service share. It goes over one
keep-alive connection pool of its own, to the route service or, with several (read replicas,
shards by model), to a ready one, failing over to the next within the route timeout
(:class:`foretoken.adapters.http.route_client.RouteClient`). After a failed call the router
decides alone for ``router.route_retry_after_failure_s`` (a circuit breaker: an overloaded
route service is not asked again and again at full timeout), with least outstanding prompt
tokens
(:func:`foretoken.core.routing.fallback.least_outstanding`) and the one decision builder.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import msgspec
import numpy as np
from multidict import CIMultiDictProxy

from foretoken.adapters.engines.engines_file import EngineConfig
from foretoken.adapters.http.route_client import RouteClient
from foretoken.adapters.http.route_page import TOKEN_HEADER
from foretoken.adapters.http.router.requests import RequestError
from foretoken.core.routing.decide import decision
from foretoken.core.routing.fallback import Load, least_outstanding
from foretoken.core.types import ModelName, RejectReason, RequestId, RouteQuery, WorkerId
from foretoken.settings import Settings
from foretoken.wire.records import Grant, as_record
from foretoken.wire.route_rpc import RouteRequest, RouteResponse

ATTEMPT_MEMORY: Final = 100_000
MAX_ALREADY_WAITED_S: Final = 3600.0
_LE_U32: Final = np.dtype("<u4")
_response = msgspec.json.Decoder(RouteResponse)
_msgpack = msgspec.msgpack.Encoder()
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no", "")


class RequestIdConflict(Exception):
    """The route service placed another request under this request id (its 409)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """What routing needs of a request."""

    request_id: RequestId
    client_id: str | None
    model: ModelName
    token_ids: np.ndarray
    max_queue_wait_s: float | None
    already_waited_s: float
    workload_class: str
    prefer_cache_hit: bool
    conversation_id: str | None
    expected_output_tokens: int | None
    cache_salt: str | None = None
    lora_name: str | None = None  # the client's model when it names a LoRA adapter

    def served_by(self, engine: EngineConfig) -> bool:
        """The engine serves this request's model (and its LoRA adapter, if it names one)."""
        return engine.model == self.model and (
            self.lora_name is None or self.lora_name in engine.lora_adapters
        )

    def query(self) -> RouteQuery:
        return RouteQuery(
            request_id=self.request_id, model=self.model, tokens=self.token_ids,
            prompt_tokens=len(self.token_ids), max_queue_wait_s=self.max_queue_wait_s,
            already_waited_s=self.already_waited_s, workload_class=self.workload_class,
            prefer_cache_hit=self.prefer_cache_hit, conversation_id=self.conversation_id,
            expected_output_tokens=self.expected_output_tokens, cache_salt=self.cache_salt,
            lora_name=self.lora_name,
        )  # fmt: skip

    def rpc(self) -> bytes:
        return _msgpack.encode(RouteRequest(
            request_id=self.request_id, model=self.model,
            packed_token_ids=np.ascontiguousarray(self.token_ids, dtype=_LE_U32).tobytes(),
            prompt_tokens=len(self.token_ids), max_queue_wait_s=self.max_queue_wait_s,
            already_waited_s=self.already_waited_s, workload_class=self.workload_class,
            prefer_cache_hit=self.prefer_cache_hit, conversation_id=self.conversation_id,
            expected_output_tokens=self.expected_output_tokens, cache_salt=self.cache_salt,
            lora_name=self.lora_name,
        ))  # fmt: skip


def _number(value: Any, name: str) -> float | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise RequestError(f"{name} must be a number", param=name)
    try:
        out = float(value)
    except (TypeError, ValueError) as exc:
        raise RequestError(f"{name} must be a number", param=name) from exc
    if not math.isfinite(out):
        raise RequestError(f"{name} must be finite", param=name)
    return out


@dataclass(frozen=True, slots=True)
class Options:
    """foretoken's own request options, from the body or its headers."""

    max_queue_wait_s: float | None
    already_waited_s: float
    workload_class: str
    prefer_cache_hit: bool
    conversation_id: str | None
    client_id: str | None


def options(settings: Settings, body: Any, headers: CIMultiDictProxy[str]) -> Options:
    cfg = settings.router
    klass = body.workload_class or headers.get("x-workload-class")
    classes = settings.controls.classes
    if klass is not None and klass not in classes:
        raise RequestError(f"unknown workload class {klass!r}; configured: {sorted(classes)}",
                           param="workload_class")  # fmt: skip
    class_name, workload = settings.controls.workload_class(klass)
    bound = _number(body.max_queue_wait_s if body.max_queue_wait_s is not None
                    else headers.get("x-max-queue-wait-s"), "max_queue_wait_s")  # fmt: skip
    if bound is not None and not cfg.min_queue_wait_s <= bound <= cfg.max_queue_wait_s:
        raise RequestError(
            f"max_queue_wait_s must be within {cfg.min_queue_wait_s:g}–{cfg.max_queue_wait_s:g} s",
            param="max_queue_wait_s",
        )  # fmt: skip
    if bound is None and workload.max_queue_wait_s is not None:
        # the class's default bound, kept within the range a client may ask for: a request
        # that names no bound is never refused for one it did not send
        bound = min(max(workload.max_queue_wait_s, cfg.min_queue_wait_s), cfg.max_queue_wait_s)
    waited = _number(body.already_waited_s if body.already_waited_s is not None
                     else headers.get("x-already-waited-s"), "already_waited_s")  # fmt: skip
    if waited is not None and not 0.0 <= waited <= MAX_ALREADY_WAITED_S:
        raise RequestError(f"already_waited_s must be within 0–{MAX_ALREADY_WAITED_S:g} s",
                           param="already_waited_s")  # fmt: skip
    prefer = body.prefer_cache_hit
    if prefer is None:
        header = headers.get("x-prefer-cache-hit", "").strip().lower()
        if header not in _TRUE + _FALSE:
            raise RequestError("x-prefer-cache-hit must be true or false",
                               param="prefer_cache_hit")  # fmt: skip
        prefer = header in _TRUE
    conversation = body.conversation_id or headers.get("x-conversation-id") or None
    client_id = headers.get("x-request-id") or None
    for name, value in (("x-conversation-id", conversation), ("x-request-id", client_id)):
        if value is not None:
            check_id(name, value)
    return Options(bound, waited or 0.0, class_name, prefer, conversation, client_id)


def is_text(value: str) -> bool:
    """UTF-8 text without control characters: not a header's invalid bytes (decoded as
    lone surrogates) nor a JSON lone surrogate, fit for Kafka records, headers and the lake."""
    if not value.isprintable():
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def check_id(name: str, value: str) -> None:
    """An id a client chose: at most 256 characters of text (:func:`is_text`)."""
    if len(value) > 256:
        raise RequestError(f"{name} must be at most 256 characters", param=name)
    if not is_text(value):
        raise RequestError(f"{name} must be UTF-8 text without control characters", param=name)


@dataclass
class Routing:
    """The route service's client and the router's fallback."""

    settings: Settings
    engines: dict[str, EngineConfig]
    session: aiohttp.ClientSession | None = None
    # Prompt tokens and requests sent to each engine and not yet answered (the fallback).
    outstanding: dict[str, Load] = field(default_factory=dict)
    route_down_until: float = 0.0
    # Client request ids (``x-request-id``) → how many requests have carried each. Every
    # request gets its own id, the client's for the first, ``<id>~<n>`` after: a retry after
    # a 429 is a new attempt with its own grant, and a client that sends one id for every
    # request (a fixed header) gets a grant and outcomes per request, not the first one's
    # decision again (the route service answers a known id with its decision: the router's
    # own failover retries one request).
    issued: OrderedDict[str, int] = field(default_factory=OrderedDict)
    # Client ids answered 429 and not yet admitted: when the first was refused (the time
    # since counts as waited).
    attempts: OrderedDict[str, float] = field(default_factory=OrderedDict)
    fallbacks: dict[str, int] = field(default_factory=dict)
    # Engines that did not answer at all → until when no request goes to them.
    down_until: dict[str, float] = field(default_factory=dict)
    # Called with the reason of each fallback decision (the metric; a diff of ``fallbacks``
    # around an await would count the concurrent requests' fallbacks too).
    on_fallback: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        self.client = RouteClient(self.settings)  # the route services (one, or several)
        if self.settings.route.token:  # the route service's shared token (route.token)
            self.client.headers[TOKEN_HEADER] = self.settings.route.token
        self.models = {e.model for e in self.engines.values()}

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0)
        self.session = aiohttp.ClientSession(connector=connector)
        await self.client.start(self.session)

    async def stop(self) -> None:
        await self.client.stop()
        if self.session is not None:
            await self.session.close()

    def attempt(self, client_id: str | None, waited_s: float) -> tuple[RequestId, float]:
        if client_id is None:
            return RequestId(uuid.uuid4().hex), waited_s
        n = self.issued.pop(client_id, 0) + 1
        self.issued[client_id] = n  # most recent last
        if len(self.issued) > ATTEMPT_MEMORY:
            self.issued.popitem(last=False)
        request_id = RequestId(client_id if n == 1 else f"{client_id}~{n}")
        first = self.attempts.get(client_id)
        if first is None:
            return request_id, waited_s
        return request_id, max(waited_s, time.monotonic() - first)

    def rejected(self, client_id: str | None) -> None:
        if client_id is None or client_id in self.attempts:
            return
        self.attempts[client_id] = time.monotonic()
        if len(self.attempts) > ATTEMPT_MEMORY:
            self.attempts.popitem(last=False)

    def admitted(self, client_id: str | None) -> None:
        if client_id is not None:
            self.attempts.pop(client_id, None)

    def sent(self, worker: str, prompt_tokens: int) -> None:
        """A request sent to ``worker`` (a negative count: it was answered)."""
        load = self.outstanding.get(worker, Load())
        requests = load.requests + (1 if prompt_tokens >= 0 else -1)
        self.outstanding[worker] = Load(max(0, load.prompt_tokens + prompt_tokens),
                                        max(0, requests))  # fmt: skip

    def unreachable(self, worker: str) -> None:
        """``worker`` did not answer (refused, or silent for the engine timeout)."""
        self.down_until[worker] = time.monotonic() + self.settings.router.engine_down_s

    def engines_down(self) -> dict[str, float]:
        """The engines held out now (not answering): seconds until each is tried again."""
        now = time.monotonic()
        return {w: round(until - now, 3) for w, until in self.down_until.items() if until > now}

    def is_down(self, worker: str | None) -> bool:
        until = self.down_until.get(worker) if worker is not None else None
        return until is not None and time.monotonic() < until

    def _fell_back(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        if self.on_fallback is not None:
            self.on_fallback(reason)

    async def decide(self, p: Placement) -> tuple[Grant, str | None]:
        """The grant (its ``request_id`` is the request's: see ``conflict``) and the URL."""
        try:
            return await self._decide(p)
        except RequestIdConflict:
            # The id names another request the route service placed (another router
            # process, or this one's memory of ids rolled over): the router owns the id, so
            # this request gets a fresh one rather than the client a 409.
            fresh = RequestId(f"{p.client_id or p.request_id}~{uuid.uuid4().hex[:12]}")
            try:
                return await self._decide(dataclasses.replace(p, request_id=fresh))
            except RequestIdConflict as exc:  # not from this router: its ids are fresh
                raise RequestError(str(exc), status=500) from exc

    async def _decide(self, p: Placement) -> tuple[Grant, str | None]:
        if time.monotonic() < self.route_down_until:
            self._fell_back("circuit_open")
            return self.fallback(p)
        assert self.session is not None
        reason = "error"
        try:  # to a ready route service, failing over to the next within the route timeout
            async with self.client.post(self.session, p.rpc(), p.model,
                                        p.conversation_id) as resp:  # fmt: skip
                body = await resp.read()
                if resp.status == 200:
                    decided = _response.decode(body)
                    if self._route_service_is_blind(decided.grant, p):
                        self._fell_back("no_worker_at_route_service")
                        return self.fallback(p)
                    if self.is_down(decided.grant.worker_id):  # it did not answer just now
                        self._fell_back("engine_down")
                        return self.fallback(p)
                    return decided.grant, decided.http_url
                if resp.status == 413:  # the route service's own body limit is lower
                    raise RequestError(
                        f"the prompt ({len(p.token_ids)} tokens) is more than the route service "
                        "accepts: its body limit is below router.max_body_bytes", status=413,
                        code="context_length_exceeded", param="prompt",
                    )  # fmt: skip
                if resp.status == 409:  # the id names another request the service placed
                    raise RequestIdConflict(f"request id {p.request_id!r} was decided for "
                                            "another request, twice")  # fmt: skip
                reason = f"http_{resp.status}"
        except TimeoutError:
            reason = "timeout"
        except (aiohttp.ClientError, msgspec.DecodeError, msgspec.ValidationError):
            reason = "unavailable"
        self._fell_back(reason)
        self.route_down_until = time.monotonic() + self.settings.router.route_retry_after_failure_s
        return self.fallback(p)

    def _route_service_is_blind(self, grant: Grant, p: Placement) -> bool:
        """The route service knows no worker of a model the engines file serves: it is
        restarting or catching up on ``workers``; the router's own policy can serve."""
        return grant.reject_reason == RejectReason.NO_WORKER_FOR_MODEL and any(
            map(p.served_by, self.engines.values())
        )

    def fallback(self, p: Placement) -> tuple[Grant, str | None]:
        """Least outstanding prompt tokens among the model's workers that can hold the prompt
        (KV capacity ``gpu_blocks × block_size`` and context ``max_model_len``, as
        registered); a 400 when none can, a 429 only when every one is past
        ``fallback_overload_tokens``."""
        cfg = self.settings.router
        n = len(p.token_ids)
        candidates = [w for w, e in self.engines.items() if p.served_by(e)]
        up = [w for w in candidates if not self.is_down(w)]
        candidates = up or candidates  # every one down: try them anyway

        def can_serve(w: str) -> bool:
            return self.engines[w].fits_prompt(n)

        worker = least_outstanding(candidates, lambda w: self.outstanding.get(w, Load()),
                                   can_serve=can_serve,
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
                            retry_after_s=None, fallback=True,
                            worker_id=WorkerId(worker))  # fmt: skip
        return as_record(Grant, admitted), self.engines[worker].http_url
