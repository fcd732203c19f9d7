"""``POST /v1/route``: the route service's edge. The wire request (packed token ids, JSON or
msgpack) is decoded into the core's query, the core decides, and the answer carries the
decision as the grant to publish plus where to send the request (the chosen engine's URL,
from the worker's registration: the core never sees URLs)."""

from __future__ import annotations

import msgspec

from foretoken.compose import ProcessorCore
from foretoken.core.types import WorkerId
from foretoken.wire.codec import decode
from foretoken.wire.records import WorkerRegistration
from foretoken.wire.route_rpc import RouteRequest, RouteResponse

_encoder = msgspec.json.Encoder()


def answer_route(
    core: ProcessorCore,
    endpoints: dict[WorkerId, WorkerRegistration],
    body: bytes | RouteRequest,
    now_s: float,
) -> bytes:
    """The JSON answer to one route request, given as its body (``DecodeError`` on a
    malformed one) or decoded."""
    request = body if isinstance(body, RouteRequest) else decode(body, RouteRequest)
    decided = core.service.route(request.query(), now_s, now_s)
    url = None
    if decided.admitted and decided.worker_id is not None:
        reg = endpoints.get(decided.worker_id)
        url = reg.endpoints.http_url if reg is not None else None
    return _encoder.encode(RouteResponse.of(decided, url))
