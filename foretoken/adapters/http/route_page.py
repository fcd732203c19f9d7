"""``POST /v1/route``: the route service's edge. The wire request (packed token ids, JSON or
msgpack) is read with limits and decoded into the core's query, the core decides, and the
answer carries the decision as the grant to publish plus where to send the request (the
chosen engine's URL, from the worker's registration: the core never sees URLs).

What reaches the core has passed every check of the wire
(:func:`foretoken.wire.route_rpc.decode_route_request`: token ids in [0, 2³²), lengths,
``prompt_tokens`` and ``expected_output_tokens`` within ``[route]``'s limits, finite times);
anything else is a 4xx JSON error naming the field, in the OpenAI error shape. The body
must arrive within ``route.read_timeout_s`` and be at most ``route.body_limit`` bytes (a
prompt of ``route.max_prompt_tokens`` always fits); a big body is decoded off the event loop.
When ``route.token`` is set, a caller without it (header ``x-foretoken-route-token``) gets 401.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Mapping

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from foretoken.compose import ProcessorCore
from foretoken.core.routing.service import RequestIdReused
from foretoken.core.types import WorkerId
from foretoken.settings import RouteSettings
from foretoken.wire.records import WorkerRegistration
from foretoken.wire.route_rpc import (
    RouteLimits,
    RouteRequest,
    RouteRequestError,
    RouteResponse,
    decode_route_request,
)

TOKEN_HEADER = "x-foretoken-route-token"
_encoder = msgspec.json.Encoder()


def limits_of(cfg: RouteSettings) -> RouteLimits:
    return RouteLimits(cfg.max_prompt_tokens, cfg.max_output_tokens)


def error_body(message: str, field: str | None, code: str = "invalid_route_request") -> bytes:
    """The OpenAI error shape; ``param`` names the field at fault (``body``: the whole)."""
    kind = "invalid_request_error" if code != "unauthorized" else "authentication_error"
    error = {"message": message, "type": kind, "param": field or "body", "code": code}
    return _encoder.encode({"error": error})


def authorized(headers: Mapping[str, str], cfg: RouteSettings) -> bool:
    """No token configured, or the caller sent it (compared in constant time)."""
    if not cfg.token:
        return True
    sent = headers.get(TOKEN_HEADER, "")
    return hmac.compare_digest(sent.encode(errors="surrogateescape"), cfg.token.encode())


async def read_body(request: web.Request, cfg: RouteSettings) -> bytes:
    """The whole body within the limits, else :class:`RouteRequestError` (413 or 408)."""
    limit = cfg.body_limit
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise RouteRequestError(f"the body must be uncompressed (Content-Encoding: "
                                f"{encoding[:32]!r})", None, 415)  # fmt: skip
    if request.content_length is not None and request.content_length > limit:
        raise RouteRequestError(f"the body ({request.content_length} bytes) exceeds the limit "
                                f"of {limit} bytes", None, 413)  # fmt: skip
    try:
        return await asyncio.wait_for(request.read(), cfg.read_timeout_s)
    except web.HTTPRequestEntityTooLarge as exc:
        raise RouteRequestError(f"the body exceeds the limit of {limit} bytes", None, 413) from exc
    except TimeoutError as exc:
        raise RouteRequestError(f"the body did not arrive within {cfg.read_timeout_s} s",
                                None, 408) from exc  # fmt: skip
    except (RequestPayloadError, HttpProcessingError, ConnectionError) as exc:
        # a body that breaks its framing, or a client gone mid-body (no traceback for it)
        raise RouteRequestError(f"the body could not be read: {exc}", None) from exc


async def read_route_request(request: web.Request, cfg: RouteSettings) -> RouteRequest:
    """Authorize, read and decode one route request (raises :class:`RouteRequestError`)."""
    if not authorized(request.headers, cfg):
        raise RouteRequestError(f"the route service needs its token ({TOKEN_HEADER})", None, 401)
    body = await read_body(request, cfg)
    if len(body) > cfg.offload_bytes:
        return await asyncio.to_thread(decode_route_request, body, limits_of(cfg))
    return decode_route_request(body, limits_of(cfg))


def answer_route(
    core: ProcessorCore,
    endpoints: dict[WorkerId, WorkerRegistration],
    request: RouteRequest,
    now_s: float,
) -> bytes:
    """The JSON answer to one decoded route request."""
    try:
        decided = core.service.route(request.query(), now_s, now_s)
    except RequestIdReused as exc:
        raise RouteRequestError(str(exc), "request_id", 409) from exc
    url = None
    if decided.admitted and decided.worker_id is not None:
        reg = endpoints.get(decided.worker_id)
        url = reg.endpoints.http_url if reg is not None else None
    return _encoder.encode(RouteResponse.of(decided, url))
