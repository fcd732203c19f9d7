"""The Anthropic Messages API in front of OpenAI-speaking engines.

``POST /v1/messages`` (streaming or not) and ``POST /v1/messages/count_tokens``. A request is
decoded strictly (text content blocks, a system prompt as a string or text blocks, stop
sequences, sampling parameters, ``metadata.user_id``, tool use — ``tools``,
``tool_choice``, ``tool_use`` and ``tool_result`` blocks: ``anthropic_tools.py``;
``cache_control`` is taken, as the engines cache prefixes on their own; ``thinking``
— enabled, adaptive or disabled, checked as Anthropic checks it, its ``display`` taken
(``_thinking``) — and an earlier answer's ``thinking`` blocks, left out of the context as
Anthropic leaves them; anything else —
images, server tools, an unknown field of the body, a message, a block or ``metadata`` — is
refused with a 400 naming it, never dropped) and translated into the chat completion the
engine streams: the same messages the router tokenizes, so what is routed is what is
prefilled (several text blocks become the chat API's text parts, which the engine's chat
template joins as for any client). The engine's OpenAI events come back as Anthropic's:
``message_start``, ``content_block_start`` (with the first text; an answer of only tool
calls has no text block), ``ping``, ``content_block_delta`` (``text_delta``, then a tool
call's ``input_json_delta``; with thinking enabled, a reasoning model's reasoning first as a
``thinking`` block: ``thinking_delta``, ``signature_delta``), ``content_block_stop``,
``message_delta`` (stop reason,
output and cache-read tokens), ``message_stop`` — or an ``error`` event when the stream
breaks.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Final, Literal

import msgspec
from aiohttp import web
from msgspec import Meta

from foretoken.adapters.http.router import anthropic_tools
from foretoken.adapters.http.router.deltas import deltas
from foretoken.adapters.http.router.proxy import Chunk, Measured, prepare, write
from foretoken.adapters.http.router.requests import (
    INT32_MAX,
    RequestError,
    ShortText,
    json_error,
)
from foretoken.core.tokenizer import content_text, transcript

OTHER_BLOCK_FIELDS: Final = (
    "source", "id", "name", "input", "tool_use_id", "content", "is_error", "thinking",
    "signature", "data", "title", "context", "citations",
)  # fmt: skip
MIN_BUDGET: Final = 1024  # Anthropic's least thinking.budget_tokens
DISPLAYS: Final = ("summarized", "omitted", None)  # thinking.display (the SDK's values)
STOP_REASONS: Final = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                       "content_filter": "refusal"}  # fmt: skip
_encoder = msgspec.json.Encoder()
_json = msgspec.json.Decoder()


class Block(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A content block: text is taken (``cache_control`` too: the engines cache prefixes on
    their own); the other types' fields are named here only so that the block is refused
    for its type, not for its first field."""

    type: ShortText
    text: str | None = None
    cache_control: Any = None
    # other block types' fields (refused by type)
    source: Any = None
    id: Any = None
    name: Any = None
    input: Any = None
    tool_use_id: Any = None
    content: Any = None
    is_error: Any = None
    thinking: Any = None
    signature: Any = None
    data: Any = None
    title: Any = None
    context: Any = None
    citations: Any = None
    # a tool_use block as the SDK serialises it (model_dump): who called the tool and the
    # toolset it came from; they say nothing the engine needs
    caller: Any = None
    toolset_name: Any = None


class Message(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Metadata(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    user_id: ShortText | None = None


class _Base(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: Annotated[str, Meta(min_length=1, max_length=256)]
    messages: Annotated[list[Message], Meta(min_length=1)]
    system: str | list[Block] | None = None
    # refused with a message of their own (below), not as unknown fields
    tools: Any = None
    tool_choice: Any = None
    thinking: Any = None
    mcp_servers: Any = None


class MessagesBody(_Base, kw_only=True, forbid_unknown_fields=True):
    max_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)]
    stream: bool | None = False
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None  # Anthropic's range
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    metadata: Metadata | None = None
    service_tier: ShortText | None = None  # accepted: this fleet has one tier
    # foretoken's own
    max_queue_wait_s: float | None = None
    already_waited_s: float | None = None
    workload_class: ShortText | None = None
    prefer_cache_hit: bool | None = None
    conversation_id: ShortText | None = None


class CountTokensBody(_Base, kw_only=True, forbid_unknown_fields=True):
    pass


_messages = msgspec.json.Decoder(MessagesBody)
_count = msgspec.json.Decoder(CountTokensBody)


Text = str | list[dict[str, Any]]  # a chat message's content: a string or text parts


def _text(content: str | list[Block] | None, where: str) -> Text:
    return _blocks(content, where, "system")[0]


def text_content(texts: list[str]) -> Text:
    """Several text blocks as the chat API's text parts (the engine's chat template joins
    them as it does for any client: vLLM with a newline), one as a string."""
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": t} for t in texts] if texts else ""


def _join(first: Text, second: Text) -> Text:
    """Two turns of one role as one message's content (Anthropic combines them)."""
    if isinstance(first, str) and isinstance(second, str):
        return f"{first}\n\n{second}"
    parts = [first] if isinstance(first, str) else first
    more = [second] if isinstance(second, str) else second
    as_parts = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts + more]
    return [p for p in as_parts if p["text"]]


def _blocks(content: str | list[Block] | None, where: str,
            role: str) -> tuple[Text, list[dict[str, Any]], list[dict[str, Any]]]:  # fmt: skip
    """A turn's text, its tool calls (an assistant's ``tool_use`` blocks) and its tool
    results (a user's ``tool_result`` blocks, as ``tool`` messages)."""
    if content is None or isinstance(content, str):
        return content or "", [], []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        if block.type == "tool_use" and role == "assistant":
            calls.append(anthropic_tools.call(block, at))
            continue
        if block.type == "tool_result" and role == "user":
            results.append(anthropic_tools.result(block, at))
            continue
        if block.type in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # an earlier answer's thinking: out of the context, as Anthropic does
        if block.type != "text":
            raise RequestError(
                f"{at}.type: content blocks of type {block.type!r} are not supported by this "
                f"router in a {role} turn (text, tool_use, tool_result)", param=f"{at}.type",
            )  # fmt: skip
        if block.text is None:
            raise RequestError(f"{at}.text is required", param=f"{at}.text")
        for name in OTHER_BLOCK_FIELDS:
            if getattr(block, name) is not None:
                field = f"{at}.{name}"
                raise RequestError(f"{field}: not a field of a text block, or not supported by "
                                   "this router", param=field)  # fmt: skip
        texts.append(block.text)
    return text_content(texts), calls, results


def _thinking(value: Any, max_tokens: int | None) -> None:
    """``thinking`` as Anthropic takes it: disabled, adaptive, or enabled with a
    ``budget_tokens`` of at least 1,024 below ``max_tokens``; adaptive and enabled with a
    ``display`` of ``summarized``, ``omitted`` or null. The thinking is the engine's (a
    reasoning model thinks as its chat template has it); the budget is not enforced: the
    chat API has no such limit, ``max_tokens`` bounds thinking and text together.

    ``display`` is taken and changes nothing: it says how Claude's thinking is shown (a
    summary of it, or none with only the signature), and the engine's reasoning text is what
    it is — no summary to give, and the thinking block is what lets a client see it. A
    client that sends it (the SDK types it) is answered, not refused."""
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    allowed = {"disabled": {"type"}, "adaptive": {"type", "display"},
               "enabled": {"type", "budget_tokens", "display"}}  # fmt: skip
    if kind not in allowed:
        raise RequestError("thinking.type must be enabled, adaptive or disabled",
                           param="thinking.type")  # fmt: skip
    for key in value:
        if key not in allowed[kind]:
            raise RequestError(f"thinking.{key}: not a field of {kind} thinking, or not "
                               "supported by this router", param=f"thinking.{key}")  # fmt: skip
    if value.get("display") not in DISPLAYS:
        raise RequestError("thinking.display must be summarized, omitted or null",
                           param="thinking.display")  # fmt: skip
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < MIN_BUDGET:
            raise RequestError(f"thinking.budget_tokens must be an integer >= {MIN_BUDGET}",
                               param="thinking.budget_tokens")  # fmt: skip
        if max_tokens is not None and budget >= max_tokens:
            raise RequestError("max_tokens must be greater than thinking.budget_tokens",
                               param="thinking.budget_tokens")  # fmt: skip


def _messages_of(body: _Base) -> list[dict[str, Any]]:
    """The chat completion's messages: the system prompt first; each turn's tool results as
    ``tool`` messages before its text; an assistant's tool calls on its message; consecutive
    text turns of one role combined, as Anthropic does (the engines' chat templates may
    refuse roles that do not alternate)."""
    _thinking(body.thinking, getattr(body, "max_tokens", None))
    if body.mcp_servers not in (None, []):
        raise RequestError("mcp_servers is not supported by this router", param="mcp_servers")
    system = [{"role": "system", "content": _text(body.system, "system")}] if body.system else []
    out: list[dict[str, Any]] = system
    first = len(out)
    for i, m in enumerate(body.messages):
        text, calls, results = _blocks(m.content, f"messages[{i}].content", m.role)
        out.extend(results)
        if results and not text:
            continue
        last = out[-1] if len(out) > first else None
        if (last is not None and last["role"] == m.role and not calls
                and not last.get("tool_calls")):  # fmt: skip
            last["content"] = _join(last["content"], text)
            continue
        message: dict[str, Any] = {"role": m.role, "content": text}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def _chat_of(body: _Base) -> tuple[dict[str, Any], bool]:
    """The chat (messages, tools, and, for a prefill, the flags with which the engine
    continues the assistant's text: vLLM's and SGLang's), and whether it is a prefill."""
    messages = _messages_of(body)
    chat: dict[str, Any] = {"messages": messages}
    given = anthropic_tools.tools(body.tools)
    if given is not None:
        chat["tools"] = given
    chat.update(anthropic_tools.tool_choice(body.tool_choice, given is not None))
    prefill = _prefill(messages, len(body.messages))
    if prefill:
        chat["continue_final_message"], chat["add_generation_prompt"] = True, False
    return chat, prefill


def _transcript(chat: dict[str, Any], prefill: bool) -> str:
    """The built-in transcript of the chat (as the simulated engines make it)."""
    return transcript(((m["role"], content_text(m.get("content"))) for m in chat["messages"]),
                      generation_prompt=not prefill)  # fmt: skip


def decode_messages(raw: bytes) -> tuple[MessagesBody, str, bytes, dict[str, Any]]:
    """The body, the built-in transcript, the engine's chat completion body, and its chat
    (messages, tools and flags: what a chat template renders)."""
    try:
        body = _messages.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise json_error(exc, raw) from exc
    chat, prefill = _chat_of(body)
    upstream: dict[str, Any] = {
        "model": body.model, **chat, "max_tokens": body.max_tokens, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            upstream[name] = getattr(body, name)
    if body.stop_sequences:
        upstream["stop"] = body.stop_sequences
    if body.metadata is not None and body.metadata.user_id:
        upstream["user"] = body.metadata.user_id
    return body, _transcript(chat, prefill), _encoder.encode(upstream), chat


def _prefill(messages: list[dict[str, Any]], given: int) -> bool:
    """Whether the last turn is the assistant's text, to be continued (Anthropic's
    "prefill"; as Anthropic's API, its text may not end in whitespace)."""
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant" or last.get("tool_calls"):
        return False
    text = content_text(last["content"])
    if text != text.rstrip():
        raise RequestError("final assistant content cannot end with trailing whitespace",
                           param=f"messages[{given - 1}].content")  # fmt: skip
    return True


def decode_count_tokens(raw: bytes) -> tuple[CountTokensBody, str, dict[str, Any]]:
    try:
        body = _count.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise json_error(exc, raw) from exc
    chat, prefill = _chat_of(body)
    return body, _transcript(chat, prefill), chat


def _stop(finish_reason: str | None, stop_reason: Any) -> tuple[str, str | None]:
    if isinstance(stop_reason, str):  # vLLM: the stop string that matched
        return "stop_sequence", stop_reason
    return STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


def _event(kind: str, data: dict[str, Any]) -> bytes:
    body = _encoder.encode({"type": kind, **data})
    return b"event: %s\ndata: %s\n\n" % (kind.encode(), body)


_PING: Final = _event("ping", {})
_TEXT: Final = {"type": "text", "text": ""}


def thinking_on(value: Any) -> bool:
    """Whether a request's (checked) ``thinking`` asks for the model's thinking."""
    return isinstance(value, dict) and value.get("type") in ("enabled", "adaptive")


class AnthropicRelay:
    """Engine events → an Anthropic answer, streamed or one JSON message. With ``thinking``
    (the request enabled it), a reasoning model's reasoning (the engine's reasoning parser)
    is a ``thinking`` block before the text; without, it is not shown (as Anthropic's)."""

    def __init__(self, request: web.Request, response: web.StreamResponse | None,
                 message_id: str, model: str, input_tokens: int,
                 reports_cached: bool = False, credited_cached: int = 0,
                 thinking: bool = False) -> None:  # fmt: skip
        self.request, self.response, self.reports_cached = request, response, reports_cached
        self.id, self.model, self.input_tokens = message_id, model, input_tokens
        # message_start goes out before the engine says what it had cached: the index's
        # credit stands in (message_delta then carries the engine's count)
        self.credited_cached = min(max(credited_cached, 0), input_tokens)
        self.thinking = thinking
        self.thought: list[str] = []
        self.text: list[str] = []
        self.tools = anthropic_tools.ToolCalls()
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.error: str | None = None
        self.started = False  # a content block was started (streaming)
        self.blocks = 0  # content blocks started (thinking, text; the tools count their own)
        self.text_block: int | None = None  # the text's block (after the thinking block)
        self.open_block: int | None = None  # the thinking or text block still open

    def _message(self) -> dict[str, Any]:
        usage: dict[str, Any] = {"input_tokens": self.input_tokens - self.credited_cached,
                                 "output_tokens": 0}  # fmt: skip
        if self.reports_cached:
            usage["cache_read_input_tokens"] = self.credited_cached
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": usage}  # fmt: skip

    async def open(self) -> None:
        if self.response is None:
            return
        await prepare(self.response, self.request)
        # the text block starts with the first text: an answer that is only tool calls has
        # none (as Anthropic answers a forced tool call)
        await write(self.response, _event("message_start", {"message": self._message()}))

    def _start(self, parts: list[bytes], block: dict[str, Any]) -> int:
        """A thinking or text block opens (its start event, streaming); its index."""
        index = self.open_block = self.blocks
        self.blocks += 1
        if self.response is not None:
            parts.append(_event("content_block_start", {"index": index, "content_block": block}))
        return index

    def _signature(self) -> str:
        """The thinking block's signature: a digest of its text (not Anthropic's: a
        thinking block sent back in a later turn is dropped, never checked)."""
        return hashlib.sha256("".join(self.thought).encode()).hexdigest()

    def _close(self, parts: list[bytes]) -> None:
        """The open thinking or text block ends (the thinking's with its signature)."""
        index, self.open_block = self.open_block, None
        if index is None or self.response is None:
            return
        if self.thought and index == 0:
            sig = {"type": "signature_delta", "signature": self._signature()}
            parts.append(_event("content_block_delta", {"index": 0, "delta": sig}))
        parts.append(_event("content_block_stop", {"index": index}))

    def _delta(self, parts: list[bytes], index: int, delta: dict[str, Any]) -> None:
        if self.response is not None:
            parts.append(_event("content_block_delta", {"index": index, "delta": delta}))

    async def send(self, events: list[tuple[bytes, Chunk | None]]) -> None:
        parts: list[bytes] = []
        for d in deltas(events):
            if d.reasoning and self.thinking and not self.text and not self.tools.calls:
                if not self.thought:
                    self._start(parts, {"type": "thinking", "thinking": "", "signature": ""})
                self.thought.append(d.reasoning)
                self._delta(parts, 0, {"type": "thinking_delta", "thinking": d.reasoning})
            if d.text and self.tools.open is None:  # (text after a tool call: none comes)
                if not self.text:
                    self._close(parts)
                    self.text_block = self._start(parts, _TEXT)
                self.text.append(d.text)
                text_delta = {"type": "text_delta", "text": d.text}
                self._delta(parts, self.blocks - 1, text_delta)  # the last block started
            if d.tool_calls:
                if self.open_block is not None and self.open_block != self.text_block:
                    self._close(parts)  # the thinking: its signature before the tools
                streaming = _event if self.response is not None else None
                parts += self.tools.add(d.tool_calls, streaming, self.open_block, self.blocks)
                if self.tools.calls:
                    self.open_block = None  # closed by the first tool call's block
            self.finish_reason = d.finish_reason or self.finish_reason
            if d.choice.get("stop_reason") is not None:
                self.stop_reason = d.choice["stop_reason"]
            elif isinstance(d.choice.get("matched_stop"), str):  # SGLang's (an int: a token)
                self.stop_reason = d.choice["matched_stop"]
        if parts and self.response is not None:
            if not self.started:  # Anthropic's order: the first block's start, then a ping
                parts.insert(1, _PING)
                self.started = True
            await write(self.response, b"".join(parts))

    async def close(self, error: str | None) -> None:
        self.error = error

    async def finish(self, m: Measured) -> None:
        """The stream's end for a streaming client (after the measurement is complete)."""
        assert self.response is not None
        if m.status == "error":
            err = {"error": {"type": "api_error", "message": m.error or "engine error"}}
            await write(self.response, _event("error", err))
            return
        stop, sequence = _stop(self.finish_reason, self.stop_reason)
        parts: list[bytes] = []
        last = self.tools.last_block()
        if last is not None:
            parts.append(_event("content_block_stop", {"index": last}))
        else:
            if not self.blocks:  # no block yet: an empty text block
                self._start(parts, _TEXT)
                parts.append(_PING)
            self._close(parts)
        await write(self.response,
                    b"".join(parts)
                    + _event("message_delta", {"delta": {"stop_reason": stop,
                                                         "stop_sequence": sequence},
                                               "usage": self.usage(m)})
                    + _event("message_stop", {}))  # fmt: skip

    def usage(self, m: Measured) -> dict[str, Any]:
        """Anthropic's usage: ``input_tokens`` are the prompt tokens *not* read from the cache
        (the total is input + cache_read + cache_creation), unlike OpenAI's prompt_tokens."""
        prompt = m.prompt_tokens or self.input_tokens
        cached = m.cached_tokens
        if cached is None and m.usage_seen and self.reports_cached:
            cached = 0  # omitted on a miss (vLLM)
        usage: dict[str, Any] = {"input_tokens": max(0, prompt - (cached or 0)),
                                 "output_tokens": m.output_tokens}  # fmt: skip
        if cached is not None:
            usage["cache_read_input_tokens"] = min(cached, prompt)
        return usage

    def _first_blocks(self) -> list[dict[str, Any]]:
        """The answer's thinking and text blocks: no text block when there was no text but
        thinking or tool calls (streamed the same way)."""
        out: list[dict[str, Any]] = []
        if self.thought:
            out.append({"type": "thinking", "thinking": "".join(self.thought),
                        "signature": self._signature()})  # fmt: skip
        if self.text or not (self.thought or self.tools.calls):
            out.append({"type": "text", "text": "".join(self.text)})
        return out

    def answer(self, m: Measured) -> dict[str, Any]:
        stop, sequence = _stop(self.finish_reason, self.stop_reason)
        return self._message() | {
            "content": [*self._first_blocks(), *self.tools.blocks()],
            "stop_reason": stop, "stop_sequence": sequence, "usage": self.usage(m),
        }  # fmt: skip
