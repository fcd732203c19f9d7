"""Forwarding a request to its engine and measuring what the client sees.

The engine is always asked to stream with usage: the first SSE event with content (text,
content, reasoning or a tool call) marks the first token, and the usage event gives the
prompt, cached and output tokens. Only those are decoded: the router decodes events until
the first token, then only the ones that carry ``"usage"`` or ``"error"`` (a byte search);
every other event goes to a streaming client as the engine's bytes, several per write.
Events end in a blank line, LF or CRLF (both are SSE).

What the client gets is a :class:`Relay`: :class:`OpenAIStream` (the engine's events, plus
``role: "assistant"`` on the first chat event when the engine leaves it out, minus the usage
event unless the client asked for it), :class:`Collected` (one JSON answer assembled from
the events: every choice, text, tool calls, logprobs) or the Anthropic translation
(``anthropic.py``). A stream that breaks — an engine error event, a dropped connection, a
timeout — always ends with an SSE error event and ``data: [DONE]``, so an SDK raises
instead of yielding nothing. An engine that refuses the request before streaming (a 4xx)
is answered with its own status and message.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import aiohttp
import msgspec
from aiohttp import web

from foretoken.core.cost.samples import decode_step_s
from foretoken.core.routing.health import ENGINE_UNREACHABLE

ERROR_BODY_MAX_BYTES: Final = 65_536
MAX_GAPS: Final = 8192  # token gaps kept per stream (a decode step's time needs a few)
DONE: Final = b"[DONE]"
# an event that carries no output token: empty text, or a chat finish with an empty delta
_EMPTY = re.compile(rb'"(?:text|content)": ?""|"delta": ?\{\s*\}')
# SGLang's /generate: the last event's finish reason is an object (read for the counts)
_FINISHED: Final = (b'"finish_reason":{', b'"finish_reason": {')
_ABORTED: Final = (b'"finish_reason":"abort"', b'"finish_reason": "abort"')  # vLLM's
_json = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[Any] | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    finish_reason: str | None = None


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class Chunk(msgspec.Struct):
    """What the router reads of one engine event."""

    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None
    object: str | None = None
    message: str | None = None
    text: Any = None  # SGLang's /generate: the text so far (or this event's piece)
    meta_info: Any = None  # and its counts (read leniently: :func:`_note_meta`)

    @property
    def has_content(self) -> bool:
        if self.text and isinstance(self.text, str):
            return True
        for c in self.choices:
            if c.text or (c.delta and (c.delta.content or c.delta.reasoning_content
                                        or c.delta.tool_calls)):  # fmt: skip
                return True
        return False

    @property
    def error_message(self) -> str | None:
        if self.error is not None:
            err = self.error
            msg = err.get("message") if isinstance(err, dict) else err
            return str(msg or "engine error")
        if self.object == "error":
            return self.message or "engine error"
        return None


_chunk = msgspec.json.Decoder(Chunk)


def read_chunk(payload: bytes) -> Chunk | None:
    try:
        return _chunk.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return None


@dataclass(slots=True)
class Measured:
    """What the router measured of one forwarded request."""

    first_token_s: float | None = None  # monotonic time of the first content token
    done_s: float | None = None
    output_tokens: int = 0
    chunks: int = 0  # events with content (the output tokens when no usage comes)
    usage_seen: bool = False
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    status: str = "ok"
    error: str | None = None
    engine_status: int = 200  # 0: the engine never answered (connect failed, or silent)
    engine_body: bytes = b""
    engine_content_type: str = "application/json"
    engine_retry_after: str | None = None  # an engine's own 429/503 says when to come back
    timed_out: bool = False  # the engine was silent for router.engine_timeout_s
    done_seen: bool = False
    finish_reason: str | None = None
    last_token_s: float | None = None  # monotonic time of the latest read with content
    gaps_s: list[float] = field(default_factory=list)  # per output token after the first

    def note_tokens(self, now_s: float, count: int, after_first: bool) -> None:
        """``count`` output tokens came in one read at ``now_s``; each after the first
        token gets an equal share of the time since the read before (a read that holds
        several tokens is one gap split evenly, not zeros)."""
        if count <= 0:
            return
        if after_first and self.last_token_s is not None and len(self.gaps_s) < MAX_GAPS:
            self.gaps_s.extend([(now_s - self.last_token_s) / count] * count)
        self.last_token_s = now_s

    @property
    def decode_step_s(self) -> float | None:
        """A decode step's time from the token gaps (:func:`decode_step_s`)."""
        return decode_step_s(self.gaps_s)

    def note_usage(self, usage: _Usage) -> None:
        self.usage_seen = True
        self.prompt_tokens = usage.prompt_tokens
        details = usage.prompt_tokens_details
        # Absent = the engine did not say; whether that means 0 depends on the engine (the
        # caller knows): vLLM with prompt-token details omits the field on a miss.
        self.cached_tokens = details.cached_tokens if details is not None else None
        if usage.completion_tokens is not None:
            self.output_tokens = usage.completion_tokens


class _Unreadable(Exception):
    """A relay could not take an engine event (a shape no engine should send)."""


class ClientGone(Exception):
    """The client went away while its answer was being written."""


async def write(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except (ConnectionError, RuntimeError) as exc:  # reset, or the transport already closed
        raise ClientGone(str(exc)) from exc


async def prepare(response: web.StreamResponse, request: web.Request) -> None:
    """Send the streamed answer's headers (the client may have gone: :class:`ClientGone`)."""
    try:
        await response.prepare(request)
    except (ConnectionError, RuntimeError) as exc:
        raise ClientGone(str(exc)) from exc


class Relay(Protocol):
    """Where the engine's events go (one client answer)."""

    async def open(self) -> None:
        """The engine answered 200: the client's answer may start."""

    async def send(self, events: list[tuple[bytes, Chunk | None]]) -> None:
        """Engine events (the ``data:`` payload, and what was decoded of it if anything)."""

    async def close(self, error: str | None) -> None:
        """The engine's stream ended; ``error`` says what broke, if anything."""


async def forward(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str],
    relay: Relay, on_first_token: Callable[[float], None], timeout: aiohttp.ClientTimeout,
) -> Measured:  # fmt: skip
    """POST ``body`` (already streaming) to ``url`` and feed the engine's events to ``relay``.
    Raises only the client's disconnect (:class:`ClientGone`) and cancellation."""
    m = Measured()
    error: str | None = None
    opened = False
    try:
        async with session.post(url, data=body, headers=headers, timeout=timeout) as resp:
            m.engine_status = resp.status
            if resp.status != 200:
                m.engine_body = await resp.content.read(ERROR_BODY_MAX_BYTES)
                m.engine_content_type = resp.content_type
                m.engine_retry_after = resp.headers.get("Retry-After")
                m.status, m.error = "error", engine_error_message(resp.status, m.engine_body)
                return m
            await relay.open()
            opened = True
            buffer, crlf = b"", False
            async for data in resp.content.iter_any():
                buffer += data
                if crlf or b"\r" in data:  # SSE lines may end in CRLF (a \r alone at the end
                    crlf = True  # of a read waits there for its \n)
                    buffer = buffer.replace(b"\r\n", b"\n")
                if b"\n\n" not in buffer:
                    continue
                *events, buffer = buffer.split(b"\n\n")
                batch = _scan(events, m, on_first_token)
                if batch:
                    try:
                        await relay.send(batch)
                    except (ClientGone, asyncio.CancelledError):
                        raise
                    except Exception as exc:  # an engine event no relay expects
                        raise _Unreadable(f"{type(exc).__name__}: {exc}"[:300]) from exc
    except ClientGone:
        raise
    except _Unreadable as exc:  # the answer is broken off as an engine error, not a 500
        error = f"engine answer unreadable: {exc}"
    except TimeoutError:  # aiohttp's read and connect timeouts are TimeoutErrors too
        m.timed_out = True
        silent = timeout.sock_read or timeout.total or 0.0
        error = f"the engine sent nothing for {silent:g} s (router.engine_timeout_s)"
    except aiohttp.ClientError as exc:
        error = f"engine stream broke: {type(exc).__name__}: {exc}".rstrip(": ")
    m.done_s = time.monotonic()
    if error is not None and not opened:  # no answer at all (refused, unreachable, silent):
        m.engine_status, m.status = 0, "error"  # the client's answer is not begun
        m.error = f"{ENGINE_UNREACHABLE}: {error}"  # the route services take it out a while
        return m
    if error is None and m.error is None and not m.done_seen:
        error = "engine stream ended without [DONE]"
    if error is not None and m.status == "ok":
        m.status, m.error = "error", error
    if not m.usage_seen:  # llama-cpp-python streams no usage: one event, one token
        m.output_tokens = m.chunks
    await relay.close(error)
    return m


def _scan(events: list[bytes], m: Measured,
          on_first_token: Callable[[float], None]) -> list[tuple[bytes, Chunk | None]]:  # fmt: skip
    """Measure what needs measuring; keep the data events (decoded only when needed)."""
    out: list[tuple[bytes, Chunk | None]] = []
    now_s, after_first, before = time.monotonic(), m.first_token_s is not None, m.chunks
    for event in events:
        start = event.find(b"data:")
        if start < 0:
            continue  # comments, event names, keep-alives
        payload = event[start + 5 :].strip()
        if payload == DONE:
            m.done_seen = True
            continue
        chunk: Chunk | None = None
        if (m.first_token_s is None or b'"usage"' in payload or b'"error"' in payload
                or _FINISHED[0] in payload or _FINISHED[1] in payload
                or _ABORTED[0] in payload or _ABORTED[1] in payload):  # fmt: skip
            chunk = read_chunk(payload)
        if chunk is None:
            if not _EMPTY.search(payload):
                m.chunks += 1
            out.append((payload, None))
            continue
        if chunk.usage is not None:
            m.note_usage(chunk.usage)
        elif isinstance(chunk.meta_info, dict):  # SGLang's /generate
            _note_meta(m, chunk.meta_info)
        message = chunk.error_message
        if message is not None:
            m.status, m.error = "error", f"engine error: {message}"
        elif any(c.finish_reason == "abort" for c in chunk.choices):  # vLLM aborted it
            m.status, m.error = "error", "engine aborted the request (finish_reason abort)"
        elif chunk.has_content:
            m.chunks += 1
            if m.first_token_s is None:
                m.first_token_s = now_s
                on_first_token(m.first_token_s)
        out.append((payload, chunk))
    m.note_tokens(now_s, m.chunks - before, after_first)
    return out


def _note_meta(m: Measured, meta: dict[str, Any]) -> None:
    """SGLang's ``meta_info``: its counts as usage (integers only), and an aborted request
    (finish reason ``abort``: SGLang's own refusal mid-stream) as an error."""

    def count(key: str) -> int | None:
        value = meta.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    m.note_usage(_Usage(count("prompt_tokens"), count("completion_tokens"),
                        _Details(count("cached_tokens"))))  # fmt: skip
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        m.status, m.error = "error", f"engine aborted: {finish.get('message') or 'no reason'}"


def event_docs(events: list[tuple[bytes, Chunk | None]]) -> Iterator[tuple[bytes, dict[str, Any]]]:
    """The events whose payload is a JSON object, decoded (the others carry nothing a client
    could parse: skipped)."""
    for payload, _ in events:
        try:
            doc = _json.decode(payload)
        except (msgspec.DecodeError, RecursionError):
            continue
        if isinstance(doc, dict):
            yield payload, doc


def is_error_doc(doc: dict[str, Any]) -> bool:
    """An engine's error event: OpenAI's ``{"error": …}`` or vLLM's ``{"object": "error"}``."""
    return doc.get("error") is not None or doc.get("object") == "error"


def engine_error_message(status: int, body: bytes) -> str:
    """The engine's own message from an error answer (OpenAI or vLLM shape), else its text."""
    try:
        doc = _json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        doc = None
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if doc.get("message"):
            return str(doc["message"])
    text = body[:500].decode(errors="replace").strip()
    return text or f"engine answered {status}"


# ---------------------------------------------------------------------------- relays


def sse_error(message: str, kind: str = "api_error") -> bytes:
    err = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return b"data: " + _encoder.encode(err) + b"\n\n"


class OpenAIStream:
    """A streaming OpenAI client: the engine's events as they come, without the usage the
    router asked for and the client did not (``include_usage``)."""

    def __init__(self, request: web.Request, response: web.StreamResponse, chat: bool,
                 wants_usage: bool, n: int = 1, reports_cached: bool = False) -> None:  # fmt: skip
        self.request, self.response = request, response
        self.chat, self.wants_usage, self.reports_cached = chat, wants_usage, reports_cached
        # the choices whose first delta has not gone out yet (each gets the role)
        self.role_pending: set[int] = set(range(n)) if chat else set()
        self.n = n
        self.error_sent = False

    async def open(self) -> None:
        await prepare(self.response, self.request)

    async def send(self, events: list[tuple[bytes, Chunk | None]]) -> None:
        parts: list[bytes] = []
        for payload, chunk in events:
            if chunk is not None:
                if not chunk.choices and chunk.usage is not None and not self.wants_usage:
                    continue  # the usage event the router asked for, not the client
                if chunk.error_message is not None:
                    self.error_sent = True
                    if chunk.error is None:  # vLLM's top-level {"object": "error", …}: the
                        # shape the SDKs raise on, else they end the stream without a word
                        parts.append(sse_error(chunk.error_message))
                        continue
                if chunk.usage is not None and not self.wants_usage:
                    # continuous_usage_stats without include_usage: the engine put usage on
                    # every chunk because the router asked for usage (already measured);
                    # vLLM gives it only with include_usage, so the client gets none
                    doc = _json.decode(payload)
                    doc.pop("usage", None)
                    payload = _encoder.encode(doc)
                elif self.reports_cached and _cached_omitted(chunk.usage):
                    doc = _json.decode(payload)
                    fill_cached(doc.get("usage"))
                    payload = _encoder.encode(doc)
            if self.role_pending and b'"choices"' in payload:
                payload = _with_role(payload, self.role_pending, self.n)
            parts.append(b"data: " + payload + b"\n\n")
        if parts:
            await write(self.response, b"".join(parts))

    async def close(self, error: str | None) -> None:
        tail = b""
        if error is not None and not self.error_sent:
            tail = sse_error(error)
        await write(self.response, tail + b"data: [DONE]\n\n")


def _cached_omitted(usage: _Usage | None) -> bool:
    details = None if usage is None else usage.prompt_tokens_details
    return usage is not None and (details is None or details.cached_tokens is None)


def fill_cached(usage: Any) -> Any:
    """A usage object with ``prompt_tokens_details.cached_tokens`` 0 where an engine that
    reports cached tokens left it out (vLLM omits it on a miss), as OpenAI's API says it."""
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if details is None:
            usage["prompt_tokens_details"] = {"cached_tokens": 0}
        elif isinstance(details, dict) and details.get("cached_tokens") is None:
            details["cached_tokens"] = 0
    return usage


def _with_role(payload: bytes, pending: set[int], n: int) -> bytes:
    """A chat event with ``role: "assistant"`` in the delta of each choice whose first event
    it is (taken off ``pending``), or the engine's bytes when nothing was missing. One
    choice: only the first event with choices is looked at. ``n`` > 1: events until every
    choice has had its first."""
    if n == 1 and b'"role"' in payload:
        pending.clear()
        return payload
    try:
        doc = _json.decode(payload)
        choices = doc.get("choices") or ()
        changed = False
        for choice in choices:
            index = choice.get("index", 0)
            if n > 1 and index not in pending:
                continue
            pending.discard(index)
            delta = choice.setdefault("delta", {})
            if isinstance(delta, dict) and "role" not in delta:
                delta["role"], changed = "assistant", True
        if n == 1 and choices:
            pending.clear()
        return _encoder.encode(doc) if changed else payload
    except (msgspec.DecodeError, AttributeError, TypeError):
        pending.clear()
        return payload


@dataclass
class _Assembly:
    index: int
    text: list[str] = field(default_factory=list)
    role: str = "assistant"
    finish_reason: str | None = None
    stop_reason: Any = None
    logprobs: dict[str, list[Any]] = field(default_factory=dict)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    # what else the engine said: a chat delta's other text (reasoning_content, reasoning,
    # refusal) joined, a choice's other fields (prompt_logprobs, token ids, …) as last said
    delta_text: dict[str, str] = field(default_factory=dict)
    other: dict[str, Any] = field(default_factory=dict)


_CHOICE_KEYS: Final = frozenset(
    {"index", "delta", "text", "finish_reason", "stop_reason", "logprobs", "message"}
)
_DELTA_KEYS: Final = frozenset({"content", "role", "tool_calls"})
_TOP_KEYS: Final = frozenset({"choices", "usage", "object", "error"})


class Collected:
    """A non-streaming client: the events assembled into one OpenAI answer."""

    def __init__(self, chat: bool, reports_cached: bool = False) -> None:
        self.chat, self.reports_cached = chat, reports_cached
        self.choices: dict[int, _Assembly] = {}
        self.head: dict[str, Any] = {}
        self.usage: Any = None
        self.error: str | None = None

    async def open(self) -> None:
        return None

    async def send(self, events: list[tuple[bytes, Chunk | None]]) -> None:
        for _, doc in event_docs(events):
            self._add(doc)

    def _add(self, doc: dict[str, Any]) -> None:
        if is_error_doc(doc):
            self.error = engine_error_message(500, _encoder.encode(doc))
            return
        for key, value in doc.items():  # id, created, model, system_fingerprint, …
            if key not in _TOP_KEYS and value is not None:
                self.head.setdefault(key, value)
        if doc.get("usage") is not None:
            self.usage = doc["usage"]
        for c in doc.get("choices") or ():
            a = self.choices.setdefault(c.get("index", 0), _Assembly(c.get("index", 0)))
            delta = c.get("delta") if self.chat else c
            if isinstance(delta, dict):
                piece = delta.get("content") if self.chat else delta.get("text")
                if piece:
                    a.text.append(piece)
                a.role = delta.get("role") or a.role
                for call in delta.get("tool_calls") or ():
                    _merge_call(a.tool_calls, call)
                for key, value in delta.items() if self.chat else ():
                    if key not in _DELTA_KEYS and isinstance(value, str):
                        a.delta_text[key] = a.delta_text.get(key, "") + value
            for key, value in c.items():
                if key in _CHOICE_KEYS or value is None:
                    continue
                if key == "token_ids" and isinstance(value, list):  # vLLM: a piece per event
                    a.other.setdefault(key, []).extend(value)
                elif key == "prompt_token_ids":
                    a.other.setdefault(key, value)  # said once, with the first event
                else:
                    a.other[key] = value
            if c.get("finish_reason"):
                a.finish_reason = c["finish_reason"]
            if c.get("stop_reason") is not None:
                a.stop_reason = c["stop_reason"]
            _merge_logprobs(a.logprobs, c.get("logprobs"))

    async def close(self, error: str | None) -> None:
        self.error = self.error or error

    def answer(self, model: str, request_id: str) -> dict[str, Any]:
        choices = []
        for index in sorted(self.choices):
            a = self.choices[index]
            text = "".join(a.text)
            choice: dict[str, Any] = {"index": index, "finish_reason": a.finish_reason or "stop"}
            if self.chat:
                message: dict[str, Any] = {"role": a.role, "content": text, **a.delta_text}
                if a.tool_calls:
                    message["tool_calls"] = [a.tool_calls[i] for i in sorted(a.tool_calls)]
                    message["content"] = text or None
                choice["message"] = message
            else:
                choice["text"] = text
            choice["logprobs"] = a.logprobs or None
            if a.stop_reason is not None:
                choice["stop_reason"] = a.stop_reason
            choices.append(a.other | choice)
        return self.head | {
            "id": self.head.get("id", f"{'chatcmpl' if self.chat else 'cmpl'}-{request_id}"),
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.head.get("created", int(time.time())),
            "model": self.head.get("model", model), "choices": choices,
            "usage": fill_cached(self.usage) if self.reports_cached else self.usage,
        }  # fmt: skip


def _merge_call(calls: dict[int, dict[str, Any]], delta: Any) -> None:
    """One streamed tool-call delta into the calls so far (an index that is not an int
    opens a new call; pieces that are not strings are left out)."""
    if not isinstance(delta, dict):
        return
    index = delta.get("index")
    if not isinstance(index, int) or isinstance(index, bool):
        index = len(calls)
    call = calls.setdefault(index, {"id": None, "type": "function",
                                    "function": {"name": "", "arguments": ""}})  # fmt: skip
    for key in ("id", "type"):
        if isinstance(delta.get(key), str) and delta[key]:
            call[key] = delta[key]
    fn = delta.get("function")
    if isinstance(fn, dict):
        for key in ("name", "arguments"):
            if isinstance(fn.get(key), str):
                call["function"][key] += fn[key]


def _merge_logprobs(into: dict[str, list[Any]], piece: Any) -> None:
    """Streamed logprobs concatenated: chat (``content``) and completions (the lists)."""
    if not isinstance(piece, dict):
        return
    for key, value in piece.items():
        if isinstance(value, list):
            into.setdefault(key, []).extend(value)
