"""SGLang's native API, ``POST /generate`` (what ``sglang.bench_serving --backend sglang``
and SGLang's own clients send), routed, predicted and graded like an OpenAI request.

The body is SGLang's ``GenerateReqInput``: ``text`` or ``input_ids`` (one prompt; a batch
is refused with a 400 that says so), ``sampling_params`` (``max_new_tokens`` is the
expected output), ``stream``, and the rest (``rid``, ``return_logprob``, ``lora_path``, …)
forwarded untouched. ``/generate`` names no model: the router serves it when it serves one
model, or when the body says which with a ``model`` field (foretoken's, like
``max_queue_wait_s`` and the other routing fields, never forwarded). Every engine of that
model must be SGLang's (vLLM has no ``/generate``: a 400 says to use ``/v1/completions``).

The engine is always asked to stream: the first event with text is the first token, and
the last one's ``meta_info`` gives the prompt, cached and output tokens. A streaming client
gets the engine's events as they come; any other gets the last event as one JSON answer, its
``text`` and ``output_ids`` whole (SGLang streams them cumulatively; an engine started with
incremental output sends pieces, which are joined).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Final

import msgspec
import numpy as np
from aiohttp import web
from msgspec import Meta

from foretoken.adapters.http.router import edge, errors
from foretoken.adapters.http.router.path import (
    SSE_HEADERS,
    STATE,
    EventStream,
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
    Chunk,
    engine_error_message,
    event_docs,
    is_error_doc,
    prepare,
    sse_error,
    write,
)
from foretoken.adapters.http.router.requests import (
    FORETOKEN_FIELDS,
    INT32_MAX,
    RequestError,
    RoutingFields,
    TokenId,
    json_error,
)

DEFAULT_MAX_NEW_TOKENS: Final = 128  # SGLang's own default
_STREAM_ON: Final = msgspec.Raw(b"true")


class SamplingParams(msgspec.Struct, kw_only=True):
    # the router reads this one; every key reaches the engine as sent
    max_new_tokens: Annotated[int, Meta(ge=0, le=INT32_MAX)] | None = None
    n: int | None = None  # several samples: SGLang answers them as a batch (refused)


class GenerateBody(RoutingFields, kw_only=True):
    text: str | list[str] | None = None
    input_ids: list[TokenId | list[TokenId]] | None = None
    sampling_params: SamplingParams | None = None
    stream: bool | None = False
    # foretoken's own, as the routing fields (never forwarded)
    model: Annotated[str, Meta(min_length=1, max_length=256)] | None = None


_body = msgspec.json.Decoder(GenerateBody)
_raw = msgspec.json.Decoder(dict[str, msgspec.Raw])
_encoder = msgspec.json.Encoder()


def decode_generate(raw: bytes, max_output_tokens: int) -> tuple[GenerateBody, bytes]:
    """The typed body and the engine's (the client's fields, minus foretoken's, streaming)."""
    try:
        body = _body.decode(raw)
        fields = _raw.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise json_error(exc, raw) from exc
    if isinstance(body.text, list) or any(isinstance(t, list) for t in body.input_ids or ()):
        raise RequestError("a batch (text or input_ids as a list of prompts) is not supported "
                           "by this router's /generate: send one prompt per request",
                           param="text" if isinstance(body.text, list)
                           else "input_ids")  # fmt: skip
    if body.sampling_params is not None and (body.sampling_params.n or 1) > 1:
        raise RequestError("sampling_params.n above 1 (SGLang answers it as a batch) is not "
                           "supported by this router's /generate: send one request per sample",
                           param="sampling_params.n")  # fmt: skip
    if (body.text is None) == (body.input_ids is None) or body.input_ids == []:
        raise RequestError("exactly one of text and input_ids is required", param="text")
    limit = body.sampling_params.max_new_tokens if body.sampling_params is not None else None
    if limit is not None and limit > max_output_tokens:
        name = "sampling_params.max_new_tokens"
        raise RequestError(f"{name} must be at most {max_output_tokens} "
                           "(router.max_output_tokens)", param=name)  # fmt: skip
    out = {k: v for k, v in fields.items() if k not in FORETOKEN_FIELDS and k != "model"}
    out["stream"] = _STREAM_ON
    return body, _encoder.encode(out)


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrived = time.monotonic()
    if not state.authorized(request):
        return unauthorized(False)
    try:
        raw = await edge.read_body(request, state.settings)
        body, upstream = await off_loop(state, len(raw), decode_generate, raw,
                                        state.settings.router.max_output_tokens)  # fmt: skip
        if body.model is None:
            if len(state.models) != 1:
                raise RequestError(f"model is required: this router serves {state.models} "
                                   "(a foretoken field of /generate)", param="model")  # fmt: skip
            body.model = state.models[0]
        check_model(state, body.model)
        base = state.adapters.get(body.model, body.model)
        kinds = sorted({e.engine for e in state.engines.values() if e.model == base})
        if kinds != ["sglang"]:
            raise RequestError(f"/generate is SGLang's native API and the engines of {base!r} "
                               f"are {', '.join(kinds)}: use /v1/completions",
                               param="model")  # fmt: skip
        ids = None if body.input_ids is None else np.asarray(body.input_ids, dtype=np.uint32)
        param = "text" if body.text is not None else "input_ids"
        tokens = await tokens_of(state, body.model, body.text, ids, param, True)
        limit = body.sampling_params.max_new_tokens if body.sampling_params else None
        p = await place(state, request, body, tokens,
                        DEFAULT_MAX_NEW_TOKENS if limit is None else limit or None)  # fmt: skip
        routed = await route(state, p, False)
    except RequestError as exc:
        return refused(state, exc, False)
    if isinstance(routed, web.Response):
        return routed
    grant, url, p = routed
    response = EventStream(headers={**SSE_HEADERS, "x-request-id": p.request_id})
    relay = NativeStream(request, response) if body.stream else NativeCollected()
    m = await relay_to_engine(state, request, p, grant, url + "/generate", upstream, relay,
                              arrived)  # fmt: skip
    if m is None:  # the client went away mid-stream
        return response
    if m.engine_status != 200:
        return edge.engine_refusal(m, False, p.request_id)
    if isinstance(relay, NativeStream):
        return response
    if m.status != "ok" or relay.error is not None or relay.last is None:
        return errors.openai_error(504 if m.timed_out else 502,
                                   relay.error or m.error or "engine error", "api_error",
                                   headers={"x-request-id": p.request_id})  # fmt: skip
    return web.Response(body=_encoder.encode(relay.answer()), content_type="application/json",
                        headers={"x-request-id": p.request_id})  # fmt: skip


class NativeStream:
    """A streaming ``/generate`` client: the engine's events as they come."""

    def __init__(self, request: web.Request, response: web.StreamResponse) -> None:
        self.request, self.response = request, response
        self.error_sent = False

    async def open(self) -> None:
        await prepare(self.response, self.request)

    async def send(self, events: list[tuple[bytes, Chunk | None]]) -> None:
        parts = []
        for payload, chunk in events:
            if chunk is not None and chunk.error_message is not None:
                self.error_sent = True
            parts.append(b"data: " + payload + b"\n\n")
        await write(self.response, b"".join(parts))

    async def close(self, error: str | None) -> None:
        tail = sse_error(error) if error is not None and not self.error_sent else b""
        await write(self.response, tail + b"data: [DONE]\n\n")


class NativeCollected:
    """A ``/generate`` client that does not stream: the last event, its text and output ids
    whole (cumulative events replace them, incremental ones are joined)."""

    def __init__(self) -> None:
        self.last: dict[str, Any] | None = None
        self.text = ""
        self.output_ids: list[Any] = []
        self.error: str | None = None

    async def open(self) -> None:
        return None

    async def send(self, events: list[tuple[bytes, Chunk | None]]) -> None:
        for payload, doc in event_docs(events):
            if is_error_doc(doc):
                self.error = engine_error_message(500, payload)
                continue
            self.last = doc
            text, ids = doc.get("text"), doc.get("output_ids")
            text = text if isinstance(text, str) else ""
            ids = ids if isinstance(ids, list) else []
            meta = doc.get("meta_info")
            done = meta.get("completion_tokens") if isinstance(meta, dict) else None
            # cumulative: the ids so far are all the tokens made (else the text grows)
            whole = len(ids) == done if ids and isinstance(done, int) else text.startswith(
                self.text)  # fmt: skip
            if whole:
                self.text, self.output_ids = text, ids
            else:
                self.text, self.output_ids = self.text + text, self.output_ids + ids

    async def close(self, error: str | None) -> None:
        self.error = self.error or error

    def answer(self) -> dict[str, Any]:
        assert self.last is not None
        out = dict(self.last)
        if "text" in out:
            out["text"] = self.text
        if "output_ids" in out:
            out["output_ids"] = self.output_ids
        return out
