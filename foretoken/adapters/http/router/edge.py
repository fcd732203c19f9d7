"""The HTTP edge every handler shares: which API's shape an answer takes, the body read
(media type, encoding, size, read timeout), the request id on every answer, and an engine's
own refusal restated in the caller's error shape.

* Shape: ``/v1/messages*`` is Anthropic's; ``/v1/chat/completions`` and ``/v1/completions``
  are OpenAI's; the endpoints both SDKs call (``/v1/models[/{id}]``, an unknown path) answer
  errors in Anthropic's shape when the request carries ``anthropic-version`` (the Anthropic
  SDK always sends it), else in OpenAI's.
* Body: JSON only. A ``Content-Type`` that names another format (msgpack, multipart) is a
  415 naming it; none at all, ``application/octet-stream`` (raw bytes), ``text/plain`` or
  ``application/x-www-form-urlencoded`` (``curl -d``'s default) is read as JSON (a body that
  is not JSON is then a 400). A compressed body is a 415 too (never inflated).
* Request id: every answer carries one — ``x-request-id`` (what the OpenAI SDK reads) and,
  for Anthropic's shape, ``request-id`` — the router's own for a routed request, else the
  client's ``x-request-id`` when it is usable text, else a fresh one.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from foretoken.adapters.http.router import errors
from foretoken.adapters.http.router.errors import anthropic_shape
from foretoken.adapters.http.router.proxy import Measured
from foretoken.adapters.http.router.requests import RequestError
from foretoken.adapters.http.router.routing import is_text
from foretoken.settings import Settings

_json = msgspec.json.Decoder()
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_NO_ID = b'"request_id":null'


# Types that say nothing reliable of the format: raw bytes (aiohttp and other clients),
# and what ``curl -d`` and simple clients send by default; the body is read as JSON.
_LENIENT: frozenset[str] = frozenset({
    "application/json", "application/octet-stream", "application/x-www-form-urlencoded",
    "text/plain",
})  # fmt: skip


def _json_media_type(value: str) -> bool:
    """JSON, or a type that says nothing reliable of the format (``_LENIENT``)."""
    media = value.split(";", 1)[0].strip().lower()
    return media in _LENIENT or (media.startswith("application/") and media.endswith("+json"))


async def read_body(request: web.Request, settings: Settings) -> bytes:
    """The request's JSON body: a 415 for another media type or a compressed body, a 413
    over ``router.max_body_bytes`` (from the declared length, before reading), a 408 when it
    does not arrive within ``router.body_read_timeout_s``."""
    cfg = settings.router
    declared = request.headers.get("Content-Type")
    if declared is not None and declared.strip() and not _json_media_type(declared):
        raise RequestError(f"the body must be JSON (Content-Type: application/json), not "
                           f"{declared.strip()[:64]!r}", status=415)  # fmt: skip
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise RequestError(f"request bodies are taken uncompressed (Content-Encoding: "
                           f"{encoding[:32]!r})", status=415)  # fmt: skip
    if request.content_length is not None and request.content_length > cfg.max_body_bytes:
        raise RequestError(f"the body ({request.content_length} bytes) is over the limit of "
                           f"{cfg.max_body_bytes} (router.max_body_bytes)", status=413)  # fmt: skip
    try:
        if request.content.is_eof():  # all of it came with the head: nothing to wait for
            return await request.read()
        async with asyncio.timeout(cfg.body_read_timeout_s):
            return await request.read()
    except (RequestPayloadError, HttpProcessingError, ConnectionResetError) as exc:
        raise RequestError(f"the body could not be read: {exc}") from exc
    except TimeoutError as exc:
        message = f"the body did not arrive within {cfg.body_read_timeout_s:g} s"
        raise RequestError(f"{message} (router.body_read_timeout_s)", status=408,
                           kind="timeout") from exc  # fmt: skip
    except web.HTTPRequestEntityTooLarge as exc:
        raise RequestError(f"the body is over the limit of {cfg.max_body_bytes} bytes "
                           "(router.max_body_bytes)", status=413) from exc  # fmt: skip


@web.middleware
async def request_ids(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """A request id on every answer that has none yet (refusals before routing, aiohttp's
    own 404/405): the SDKs show it in their errors (``x-request-id``, ``request-id``)."""
    response = await handler(request)
    if response.prepared:
        return response  # a stream: its headers went out with the router's id
    rid = response.headers.get("x-request-id") or response.headers.get("request-id")
    if rid is None:
        given = request.headers.get("x-request-id")
        rid = given if given and len(given) <= 256 and is_text(given) else uuid.uuid4().hex
    response.headers.setdefault("x-request-id", rid)
    if anthropic_shape(request):
        response.headers.setdefault("request-id", rid)
        body = response.body if isinstance(response, web.Response) else None
        if isinstance(body, bytes) and _NO_ID in body:  # an error said before the id was known
            assert isinstance(response, web.Response)
            response.body = body.replace(_NO_ID, b'"request_id":' + msgspec.json.encode(rid), 1)
    return response


_CORS_EXPOSED = "x-request-id, request-id, retry-after, retry-after-ms, x-should-retry"


def cors(app: web.Application, origins: tuple[str, ...]) -> None:
    """CORS for browser clients (``router.cors_origins``; ``*`` for any): a preflight
    ``OPTIONS`` is answered 204 before routing and authentication (it carries no key), and
    every answer to an allowed origin — streams too, before their headers go — says so and
    exposes the ids and retry headers."""
    allowed = frozenset(origins)

    def allow(request: web.Request) -> str | None:
        origin = request.headers.get("Origin")
        if origin is None or not ("*" in allowed or origin in allowed):
            return None
        return "*" if "*" in allowed else origin

    @web.middleware
    async def preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = allow(request)
        if (origin is None or request.method != "OPTIONS"
                or "Access-Control-Request-Method" not in request.headers):  # fmt: skip
            return await handler(request)
        asked = request.headers.get("Access-Control-Request-Headers", "")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Origin": origin, "Vary": "Origin",
            "Access-Control-Allow-Methods": "GET, HEAD, POST, OPTIONS",
            "Access-Control-Allow-Headers": asked if is_text(asked) else "",
            "Access-Control-Max-Age": "600"})  # fmt: skip

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        origin = allow(request)
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = _CORS_EXPOSED
            response.headers["Vary"] = "Origin"

    app.middlewares.insert(0, preflight)
    app.on_response_prepare.append(on_prepare)


def engine_refusal(m: Measured, anthropic: bool, request_id: str) -> web.Response:
    """The engine refused before streaming: its status (a 5xx other than 503 becomes 502;
    a 429 or 503 keeps the engine's ``Retry-After``) and its message,
    restated in the caller's error shape (an engine may answer TGI's ``{"error": "…"}`` or
    vLLM's top-level ``{"object": "error", …}``); its own type, param and code are kept for
    an OpenAI caller."""
    status = m.engine_status if 400 <= m.engine_status < 500 or m.engine_status == 503 else 502
    message = m.error or f"engine answered {m.engine_status}"
    if m.engine_status == 0:  # no answer at all: unreachable (502) or silent (504)
        status = 504 if m.timed_out else 502  # (the message names it: ENGINE_UNREACHABLE)
    elif status == 502:
        message = f"engine answered {m.engine_status}: {message}"
    headers = {"x-request-id": request_id}
    retry_after = m.engine_retry_after
    if status in (429, 503) and retry_after and len(retry_after) <= 64 and is_text(retry_after):
        headers["retry-after"] = retry_after.strip()  # the engine's own: the SDKs wait that long
    if anthropic:
        return errors.anthropic_error(status, message, request_id, headers | {
            "request-id": request_id})  # fmt: skip
    kind, param, code = ("api_error" if status >= 500 else "invalid_request_error"), None, None
    try:
        doc = _json.decode(m.engine_body)
    except (msgspec.DecodeError, RecursionError):
        doc = None
    err = doc.get("error") if isinstance(doc, dict) else None
    detail = err if isinstance(err, dict) else doc if isinstance(doc, dict) else {}
    if status < 500:
        given_kind, given_param, given_code = (detail.get(k) for k in ("type", "param", "code"))
        kind = given_kind if isinstance(given_kind, str) else kind
        param = given_param if isinstance(given_param, str) else None
        code = given_code if isinstance(given_code, (str, int)) else None
    return errors.openai_error(status, message, kind, code, param, headers)


def api_keys(settings: Settings) -> tuple[bytes, ...]:
    """The keys a client may present: ``router.api_keys`` and the lines of
    ``router.api_keys_file``."""
    keys = list(settings.router.api_keys)
    if settings.router.api_keys_file:
        text = Path(settings.router.api_keys_file).expanduser().read_text(encoding="utf-8-sig")
        keys += [line.strip() for line in text.splitlines() if line.strip()]
    return tuple(k.encode() for k in keys)
