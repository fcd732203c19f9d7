"""Error answers in the shape each client parses, and the 429 that tells a client what it
needs.

OpenAI: ``{"error": {"message", "type", "param", "code"}}``; Anthropic (``/v1/messages``):
``{"type": "error", "error": {"type", "message"}, "request_id"}``. A rejection says whether
waiting can help: ``Retry-After`` / ``retry-after-ms`` when the route service named a delay,
``x-should-retry: false`` when no delay can make the request meet its bound (its prefill alone
exceeds it, or a retry after the delay would already have waited past it) — the official
clients then do not retry. The message and ``x-foretoken-*`` headers say what failed: the
predicted TTFT against the client's bound, or the fleet's overload.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Final

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from foretoken.core.types import RejectReason
from foretoken.wire.records import Grant

ANTHROPIC_KIND: Final = {
    400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
    403: "permission_error", 404: "not_found_error", 408: "timeout_error",
    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
    504: "timeout_error", 529: "overloaded_error",
}  # fmt: skip
OPENAI_PATHS: Final = ("/v1/chat/completions", "/v1/completions")
_encoder = msgspec.json.Encoder()
log = logging.getLogger(__name__)


def _json(status: int, body: object, headers: dict[str, str] | None) -> web.Response:
    return web.Response(body=_encoder.encode(body), status=status, headers=headers,
                        content_type="application/json")  # fmt: skip


def anthropic_shape(request: web.Request) -> bool:
    """Whether this request's errors take Anthropic's shape: ``/v1/messages*`` always, the
    OpenAI endpoints never, the shared ones (``/v1/models``, an unknown path) when the
    request carries ``anthropic-version`` (the Anthropic SDK always sends it)."""
    path = request.path
    if path.startswith("/v1/messages"):
        return True
    if path.startswith(OPENAI_PATHS):
        return False
    return "anthropic-version" in request.headers


def anthropic_kind(status: int) -> str:
    """Anthropic's error type for a status (another 4xx: ``invalid_request_error``)."""
    return ANTHROPIC_KIND.get(status, "invalid_request_error" if status < 500 else "api_error")


def openai_error(status: int, message: str, kind: str = "invalid_request_error",
                 code: str | int | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> web.Response:  # fmt: skip
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return _json(status, body, headers)


def anthropic_error(status: int, message: str, request_id: str | None = None,
                    headers: dict[str, str] | None = None) -> web.Response:  # fmt: skip
    kind = anthropic_kind(status)
    body = {"type": "error", "error": {"type": kind, "message": message},
            "request_id": request_id}  # fmt: skip
    return _json(status, body, headers)


def error(anthropic: bool, status: int, message: str, *, kind: str = "invalid_request_error",
          code: str | None = None, param: str | None = None, request_id: str | None = None,
          headers: dict[str, str] | None = None) -> web.Response:  # fmt: skip
    if anthropic:
        return anthropic_error(status, message, request_id, headers)
    return openai_error(status, message, kind, code, param, headers)


def waiting_helps(grant: Grant) -> bool:
    """A retry after the advised delay could be admitted: there is a delay, and the time
    already waited plus that delay still leaves room within the bound."""
    if grant.retry_after_s is None:
        return False
    bound = grant.max_queue_wait_s
    return bound is None or grant.already_waited_s + grant.retry_after_s < bound


def rejection_message(grant: Grant) -> str:
    reason, bound, waited = grant.reject_reason, grant.max_queue_wait_s, grant.already_waited_s
    retry = grant.retry_after_s
    if reason == RejectReason.ADMISSION_CONTROL:
        head = f"workload class {grant.workload_class!r} is being shed by the latency controls"
    elif reason == RejectReason.NO_WORKER_FOR_MODEL:
        head = f"no worker serves model {grant.model!r} right now"
    elif bound is not None and grant.predicted_ttft_s is not None:
        head = (
            f"the predicted time to first token, {grant.predicted_ttft_s:.2f} s (queue wait "
            f"{grant.queue_wait_s or 0.0:.2f} s + prefill {grant.prefill_s or 0.0:.2f} s), "
            f"exceeds this request's bound max_queue_wait_s = {bound:g} s "
            f"({waited:.2f} s already waited)"
        )
    else:
        head = "every worker of this model is overloaded"
        if grant.queue_wait_s is not None:
            head += f" (best predicted queue wait {grant.queue_wait_s:.2f} s)"
    if reason == RejectReason.PREFILL_EXCEEDS_BOUND:
        return f"{head}; waiting cannot help: the prefill alone exceeds the bound"
    if retry is None:
        return f"{head}; waiting cannot help"
    if not waiting_helps(grant):
        return (f"{head}; waiting cannot help: the fleet needs {retry:.2f} s, and a retry then "
                "would already have waited past the bound")  # fmt: skip
    return f"{head}; retry after {retry:.2f} s"


def rejection(grant: Grant, anthropic: bool) -> web.Response:
    """429 (503 when no worker serves the model) with what the client needs to decide."""
    headers = {"x-request-id": grant.request_id,
               "x-foretoken-reject-reason": str(grant.reject_reason)}  # fmt: skip
    if grant.retry_after_s is not None:
        retry_s = max(grant.retry_after_s, 0.001)
        headers["Retry-After"] = str(max(1, math.ceil(retry_s)))
        headers["retry-after-ms"] = str(max(1, round(retry_s * 1000)))
    if not waiting_helps(grant):
        headers["x-should-retry"] = "false"
    if grant.predicted_ttft_s is not None:
        headers["x-foretoken-predicted-ttft-s"] = f"{grant.predicted_ttft_s:.3f}"
    if grant.max_queue_wait_s is not None:
        headers["x-foretoken-max-queue-wait-s"] = f"{grant.max_queue_wait_s:g}"
    status = 503 if grant.reject_reason == RejectReason.NO_WORKER_FOR_MODEL else 429
    message = f"request {grant.request_id}: {rejection_message(grant)}"
    if anthropic:
        return anthropic_error(status, message, grant.request_id, headers)
    code = "ttft_bound_exceeded" if grant.max_queue_wait_s is not None else str(grant.reject_reason)
    return openai_error(status, message, "rate_limit_exceeded", code, None, headers)


@web.middleware
async def json_http_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """aiohttp's own answers (no such path, method not allowed, …) in the API's error
    shape, as the handlers' are: a client's SDK parses every error body as JSON. A handler's
    unexpected exception (a bug) is logged with its traceback and answered as a 500 in that
    shape too, not aiohttp's text/plain page — unless the answer had begun (a stream's
    bytes went out): then aiohttp closes the connection, as it would have."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        where = f"{request.method} {request.path[:200]}"
        message = {404: f"no such endpoint: {where}",
                   405: f"method not allowed: {where}"}.get(exc.status, exc.reason)  # fmt: skip
        allow = exc.headers.get("Allow")
        return error(anthropic_shape(request), exc.status, message,
                     code="not_found" if exc.status == 404 else None,
                     headers={"Allow": allow} if allow else None)  # fmt: skip
    except ClientFaults.FAULTS:
        raise  # the client's doing: aiohttp's server says it in one line (ClientFaults)
    except Exception as exc:
        if request.writer.output_size > 0:
            raise  # an answer is under way: nothing else can be said on this connection
        log.exception("unexpected error answering %s %s", request.method, request.path[:200])
        return error(anthropic_shape(request), 500, f"internal error in the router: "
                     f"{type(exc).__name__}", kind="api_error")  # fmt: skip


class ClientFaults(logging.Filter):
    """Drops the traceback aiohttp's server logs for what a client alone causes (a broken
    request line or framing, a connection reset mid-body): one line says it instead, so
    that a stranger's bytes cannot flood the log with stack traces."""

    FAULTS = (HttpProcessingError, ConnectionResetError, RequestPayloadError)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, self.FAULTS):
            record.msg, record.args = "a client's request failed: %s: %s", (type(exc).__name__, exc)
            record.exc_info, record.exc_text, record.levelno = None, None, logging.INFO
            record.levelname = "INFO"
            return logging.getLogger(record.name).isEnabledFor(logging.INFO)
        return True
