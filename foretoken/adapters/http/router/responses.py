"""OpenAI's Responses API in front of chat-completion engines: ``POST /v1/responses``.

The text subset a stateless router can serve, decoded strictly: ``input`` as a string or a
list of messages (``user``, ``system``, ``developer`` — sent as ``system`` —, ``assistant``;
content as a string or ``input_text`` / ``output_text`` parts), ``instructions`` (a system
message first), ``max_output_tokens``, ``temperature``, ``top_p``, ``user``, ``metadata``;
accepted and honoured as nothing to do: ``store`` (nothing is stored), ``service_tier``,
``truncation: "disabled"``, ``parallel_tool_calls``, ``prompt_cache_key``,
``safety_identifier``, ``stream_options``. What it cannot honour — tools, a
``previous_response_id`` or ``conversation`` (no state kept), reasoning settings, images and
files, structured output, ``include``, background mode — is refused with a 400 naming it,
never dropped; ``tools: []``, ``tool_choice: "none"`` / ``"auto"`` without tools and
``text: {"format": {"type": "text"}}`` ask for nothing and are taken.

The request becomes the chat completion the engine streams (the messages the router
tokenizes, so what is routed is what is prefilled), and the engine's events come back as the
Responses API's: ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` …, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done`` and ``response.completed``
(``response.incomplete`` when ``max_output_tokens`` cut the text, ``response.failed`` when the
stream broke), numbered by ``sequence_number``; or, not streamed, the whole ``response``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Final, Literal

import msgspec
from aiohttp import web
from msgspec import Meta

from foretoken.adapters.http.router.proxy import Chunk, ClientGone, Measured, write
from foretoken.adapters.http.router.requests import (
    INT32_MAX,
    RequestError,
    ShortText,
    json_error,
)
from foretoken.core.tokenizer import transcript

TEXT_PARTS: Final = ("input_text", "output_text", "text", "refusal")
ROLES: Final = {"user": "user", "system": "system", "developer": "system",
                "assistant": "assistant"}  # fmt: skip
_encoder = msgspec.json.Encoder()
_json = msgspec.json.Decoder()


class Part(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A content part: text is taken; the other types' fields are named so that a part is
    refused for its type, not for its first field."""

    type: ShortText
    text: str | None = None
    refusal: str | None = None  # an assistant turn's refusal part (sent back as history)
    annotations: Any = None  # an assistant turn's output_text (sent back as history)
    logprobs: Any = None
    image_url: Any = None
    file_id: Any = None
    file_data: Any = None
    file_url: Any = None
    filename: Any = None
    detail: Any = None
    input_audio: Any = None


class Item(msgspec.Struct, kw_only=True):
    """An input item; only messages are taken (other item types hold fields of their own,
    so the struct takes any field and the type decides)."""

    type: ShortText | None = None
    role: ShortText | None = None
    content: str | list[Part] | None = None


class ResponsesBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: Annotated[str, Meta(min_length=1, max_length=256)]
    input: str | list[Item]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None
    stream: bool | None = False
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    user: ShortText | None = None
    metadata: Annotated[dict[Annotated[str, Meta(max_length=64)],
                             Annotated[str, Meta(max_length=512)]],
                        Meta(max_length=16)] | None = None  # OpenAI's limits  # fmt: skip
    # vLLM's: the engine keys the prompt's first block with it (forwarded)
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    # accepted: nothing to do for them here (store: false only; nothing is stored)
    store: bool | None = None
    service_tier: ShortText | None = None
    truncation: Literal["disabled"] | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: ShortText | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: ShortText | None = None
    stream_options: Any = None
    # refused unless they ask for nothing (below)
    tools: Any = None
    tool_choice: Any = None
    previous_response_id: Any = None
    conversation: Any = None
    reasoning: Any = None
    include: Any = None
    background: Any = None
    prompt: Any = None
    text: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    # foretoken's own
    max_queue_wait_s: float | None = None
    already_waited_s: float | None = None
    workload_class: ShortText | None = None
    prefer_cache_hit: bool | None = None
    conversation_id: ShortText | None = None


_body = msgspec.json.Decoder(ResponsesBody)


def _asks_nothing(name: str, value: Any, body: ResponsesBody) -> bool:
    if value is None or value is False or value == [] or value == 0:
        return True
    if name == "tool_choice":
        return value == "none" or (value == "auto" and not body.tools)
    if name == "text":
        return value == {"format": {"type": "text"}} or value == {}
    return name == "reasoning" and value == {}


def _texts(content: str | list[Part] | None, where: str) -> str | list[str]:
    """A message's text: a string, or its parts' texts (sent to the engine as parts, which
    its chat template joins as it does for chats)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS:
            raise RequestError(f"{where}[{j}].type: content parts of type {part.type!r} are not "
                               "supported by this router (text only)",
                               param=f"{where}[{j}].type")  # fmt: skip
        text = part.refusal if part.type == "refusal" else part.text
        if text is None:
            field = "refusal" if part.type == "refusal" else "text"
            raise RequestError(f"{where}[{j}].{field} is required",
                               param=f"{where}[{j}].{field}")  # fmt: skip
        texts.append(text)
    return texts


INCOMPLETE: Final = {"length": "max_output_tokens", "content_filter": "content_filter"}
REFUSED: Final = (
    "tools", "tool_choice", "previous_response_id", "conversation", "reasoning", "include",
    "background", "prompt", "text", "top_logprobs", "max_tool_calls",
)  # fmt: skip


def _turns(body: ResponsesBody) -> list[tuple[str, str | list[str]]]:
    for name in REFUSED:
        if not _asks_nothing(name, getattr(body, name), body):
            raise RequestError(f"{name} is not supported by this router (a stateless, text-only "
                               "Responses API)", param=name)  # fmt: skip
    if body.store:
        raise RequestError("store: true is not supported by this router (it keeps no "
                           "responses): send store: false", param="store")  # fmt: skip
    turns: list[tuple[str, str | list[str]]] = (
        [("system", body.instructions)] if body.instructions else [])  # fmt: skip
    if isinstance(body.input, str):
        return [*turns, ("user", body.input)]
    for i, item in enumerate(body.input):
        if item.type not in (None, "message"):
            raise RequestError(f"input[{i}].type: input items of type {item.type!r} are not "
                               "supported by this router (messages only)",
                               param=f"input[{i}].type")  # fmt: skip
        role = ROLES.get(item.role or "")
        if role is None:
            raise RequestError(f"input[{i}].role must be one of {sorted(ROLES)}",
                               param=f"input[{i}].role")  # fmt: skip
        turns.append((role, _texts(item.content, f"input[{i}].content")))
    if not turns:
        raise RequestError("input has no messages", param="input")
    return turns


def decode_responses(raw: bytes) -> tuple[ResponsesBody, str, bytes, dict[str, Any]]:
    """The body, the built-in transcript, the engine's chat completion body, and its chat
    (what a chat template renders)."""
    try:
        body = _body.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise json_error(exc, raw) from exc
    turns = _turns(body)
    chat: dict[str, Any] = {"messages": [
        {"role": r, "content": t if isinstance(t, str) else
         [{"type": "text", "text": x} for x in t]} for r, t in turns]}  # fmt: skip
    upstream: dict[str, Any] = {"model": body.model, **chat, "stream": True,
                                "stream_options": {"include_usage": True}}  # fmt: skip
    sent_as = (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
               ("top_p", "top_p"), ("user", "user"), ("cache_salt", "cache_salt"))  # fmt: skip
    for name, sent in sent_as:
        if getattr(body, name) is not None:
            upstream[sent] = getattr(body, name)
    flat = [(r, t if isinstance(t, str) else "".join(t)) for r, t in turns]  # as the sim joins
    return body, transcript(flat), _encoder.encode(upstream), chat


class ResponsesRelay:
    """Engine events → a Responses API answer, streamed or one JSON response."""

    def __init__(self, request: web.Request, response: web.StreamResponse | None,
                 body: ResponsesBody, request_id: str, input_tokens: int,
                 reports_cached: bool = False) -> None:  # fmt: skip
        self.request, self.response, self.body = request, response, body
        self.id, self.item_id = f"resp_{request_id}", f"msg_{request_id}"
        self.input_tokens, self.reports_cached = input_tokens, reports_cached
        self.created = int(time.time())
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.sequence = 0

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        doc = {"type": kind, **data, "sequence_number": self.sequence}
        self.sequence += 1
        return b"event: %s\ndata: %s\n\n" % (kind.encode(), _encoder.encode(doc))

    def _part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": "".join(self.text), "annotations": [],
                "logprobs": []}  # fmt: skip

    def _item(self, status: str) -> dict[str, Any]:
        content = [self._part()] if status != "in_progress" else []
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": content}  # fmt: skip

    def response_doc(self, status: str, m: Measured | None = None,
                     error: str | None = None) -> dict[str, Any]:  # fmt: skip
        b = self.body
        done = status in ("completed", "incomplete") or (status == "failed" and self.text)
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": {"code": "server_error", "message": error} if error else None,
            "incomplete_details": {"reason": INCOMPLETE.get(self.finish_reason or "",
                                                            "max_output_tokens")}
            if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "model": b.model,
            "output": [self._item("completed" if status == "completed" else "incomplete")]
            if done else [],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": b.temperature, "top_p": b.top_p, "text": {"format": {"type": "text"}},
            "tool_choice": "none", "tools": [], "truncation": "disabled", "user": b.user,
            "metadata": b.metadata or {}, "usage": self.usage(m) if m is not None else None,
        }  # fmt: skip

    def usage(self, m: Measured) -> dict[str, Any]:
        prompt = m.prompt_tokens or self.input_tokens
        cached = m.cached_tokens or 0
        return {"input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": min(cached, prompt),
                                         "cache_write_tokens": 0},
                "output_tokens": m.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + m.output_tokens}  # fmt: skip

    async def open(self) -> None:
        if self.response is None:
            return
        try:
            await self.response.prepare(self.request)
        except (ConnectionError, RuntimeError) as exc:
            raise ClientGone(str(exc)) from exc
        started = self.response_doc("in_progress")
        await write(self.response,
                    self._event("response.created", {"response": started})
                    + self._event("response.in_progress", {"response": started})
                    + self._event("response.output_item.added",
                                  {"output_index": 0, "item": self._item("in_progress")})
                    + self._event("response.content_part.added", {
                        "item_id": self.item_id, "output_index": 0, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": [],
                                 "logprobs": []}}))  # fmt: skip

    async def send(self, events: list[tuple[bytes, Chunk | None]]) -> None:
        parts: list[bytes] = []
        for payload, _ in events:
            try:
                doc = _json.decode(payload)
            except (msgspec.DecodeError, RecursionError):
                continue
            if not isinstance(doc, dict):
                continue
            for c in doc.get("choices") or ():
                delta = c.get("delta") or {}
                piece = delta.get("content") if isinstance(delta, dict) else None
                if piece:
                    self.text.append(piece)
                    if self.response is not None:
                        parts.append(self._event("response.output_text.delta", {
                            "item_id": self.item_id, "output_index": 0, "content_index": 0,
                            "delta": piece, "logprobs": []}))  # fmt: skip
                self.finish_reason = c.get("finish_reason") or self.finish_reason
        if parts and self.response is not None:
            await write(self.response, b"".join(parts))

    async def close(self, error: str | None) -> None:
        pass

    @property
    def status(self) -> str:
        """``incomplete`` when the length or a content filter cut the text (``failed`` when
        the engine aborted it: ``finish``)."""
        return "incomplete" if self.finish_reason in INCOMPLETE else "completed"

    async def finish(self, m: Measured) -> None:
        """The stream's end for a streaming client (after the measurement is complete)."""
        assert self.response is not None
        if m.status == "error" or self.finish_reason == "abort":
            error = m.error or "the engine aborted the request"
            failed = self.response_doc("failed", m, error)
            await write(self.response, self._event("response.failed", {"response": failed}))
            return
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        text = "".join(self.text)
        status = self.status
        await write(self.response,
                    self._event("response.output_text.done", {**where, "text": text,
                                                              "logprobs": []})
                    + self._event("response.content_part.done", {**where, "part": self._part()})
                    + self._event("response.output_item.done", {
                        "output_index": 0,
                        "item": self._item("completed" if status == "completed" else status)})
                    + self._event(f"response.{status}",
                                  {"response": self.response_doc(status, m)}))  # fmt: skip

    def answer(self, m: Measured) -> dict[str, Any]:
        if self.finish_reason == "abort":
            return self.response_doc("failed", m, "the engine aborted the request")
        return self.response_doc(self.status, m)
