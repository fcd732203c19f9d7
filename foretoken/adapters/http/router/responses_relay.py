"""The engine's chat completion stream as a Responses API answer (``responses.py``).

Output items open as the engine's deltas come: a ``reasoning`` item at a reasoning model's
reasoning (the engine's ``reasoning_content`` / ``reasoning``), the assistant's ``message``
at its first text, a ``function_call`` at each new tool call (the one before closed first,
as OpenAI's items follow one another); streamed, each with its events —
``response.output_item.added``, ``response.reasoning_text.delta`` … ``.done`` for
reasoning, ``response.content_part.added`` / ``response.output_text.delta`` … ``.done`` for text,
``response.function_call_arguments.delta`` … ``.done`` for a call, then
``response.output_item.done`` — between ``response.created`` / ``response.in_progress`` and
``response.completed`` (``response.incomplete`` when the length or a content filter cut it,
``response.failed`` when the stream broke or the engine aborted), every event numbered by
``sequence_number``. An answer with neither text nor calls has an empty message.
"""

from __future__ import annotations

import time
from typing import Any, Final

import msgspec
from aiohttp import web

from foretoken.adapters.http.router.deltas import deltas, tool_pieces
from foretoken.adapters.http.router.proxy import Chunk, Measured, prepare, write

INCOMPLETE: Final = {"length": "max_output_tokens", "content_filter": "content_filter"}
_encoder = msgspec.json.Encoder()


class ResponsesRelay:
    """Engine events → a Responses API answer, streamed or one JSON response."""

    def __init__(self, request: web.Request, response: web.StreamResponse | None,
                 body: Any, request_id: str, input_tokens: int,
                 reports_cached: bool = False) -> None:  # fmt: skip
        self.request, self.response, self.body = request, response, body
        self.rid, self.id = request_id, f"resp_{request_id}"
        self.input_tokens, self.reports_cached = input_tokens, reports_cached
        self.created = int(time.time())
        self.items: list[dict[str, Any]] = []  # output items, in order (their state)
        self.open_item: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # the engine's tool index → its item
        self.finish_reason: str | None = None
        self.sequence = 0

    # ------------------------------------------------------------------ items

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        doc = {"type": kind, **data, "sequence_number": self.sequence}
        self.sequence += 1
        return b"event: %s\ndata: %s\n\n" % (kind.encode(), _encoder.encode(doc))

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _doc(self, item: dict[str, Any], status: str) -> dict[str, Any]:
        """An item as the API shows it (``status``: in_progress, completed, incomplete)."""
        if item["type"] == "reasoning":
            content = [] if status == "in_progress" else [
                {"type": "reasoning_text", "text": "".join(item["text"])}]  # fmt: skip
            return {"type": "reasoning", "id": item["id"], "summary": [], "content": content,
                    "encrypted_content": None, "status": status}  # fmt: skip
        if item["type"] == "message":
            content = [] if status == "in_progress" else [self._part("".join(item["text"]))]
            return {"type": "message", "id": item["id"], "status": status,
                    "role": "assistant", "content": content}  # fmt: skip
        return {
            "type": "function_call",
            "id": item["id"],
            "call_id": item["call_id"],
            "name": item["name"],
            "arguments": "".join(item["args"]),
            "status": status,
        }

    def _start(self, item: dict[str, Any]) -> list[bytes]:
        out = self._finish_open()
        item["index"] = len(self.items)
        self.items.append(item)
        self.open_item = item
        if self.response is None:
            return out
        out.append(self._event("response.output_item.added", {
            "output_index": item["index"], "item": self._doc(item, "in_progress")}))  # fmt: skip
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", {
                "item_id": item["id"], "output_index": item["index"], "content_index": 0,
                "part": self._part("")}))  # fmt: skip
        return out

    def _finish_open(self, status: str = "completed") -> list[bytes]:
        item, self.open_item = self.open_item, None
        if item is None or self.response is None:
            return []
        at = {"item_id": item["id"], "output_index": item["index"]}
        if item["type"] == "reasoning":
            out = [self._event("response.reasoning_text.done", {
                **at, "content_index": 0, "text": "".join(item["text"])})]  # fmt: skip
        elif item["type"] == "message":
            text = "".join(item["text"])
            out = [
                self._event(
                    "response.output_text.done",
                    {**at, "content_index": 0, "text": text, "logprobs": []},
                ),
                self._event(
                    "response.content_part.done",
                    {**at, "content_index": 0, "part": self._part(text)},
                ),
            ]
        else:
            out = [self._event("response.function_call_arguments.done", {
                **at, "name": item["name"], "arguments": "".join(item["args"])})]  # fmt: skip
        out.append(self._event("response.output_item.done", {
            "output_index": item["index"], "item": self._doc(item, status)}))  # fmt: skip
        return out

    def _text(self, piece: str) -> list[bytes]:
        return self._piece("message", "msg", piece, "response.output_text.delta", logprobs=[])

    def _reasoning(self, piece: str) -> list[bytes]:
        """A reasoning model's reasoning (the engine's reasoning parser) as a ``reasoning``
        item: a new one after any other item (reasoning may come between tool calls)."""
        return self._piece("reasoning", "rs", piece, "response.reasoning_text.delta")

    def _piece(self, kind: str, prefix: str, piece: str, event: str,
               **extra: Any) -> list[bytes]:  # fmt: skip
        """One piece of a text item of ``kind`` (opened if another item is open); its
        delta event, streaming."""
        out: list[bytes] = []
        item = self.open_item
        if item is None or item["type"] != kind:
            item = {"type": kind, "id": f"{prefix}_{self.rid}_{len(self.items)}", "text": []}
            out += self._start(item)
        item["text"].append(piece)
        if self.response is not None:
            out.append(self._event(event, {
                "item_id": item["id"], "output_index": item["index"], "content_index": 0,
                "delta": piece, **extra}))  # fmt: skip
        return out

    def _tool_calls(self, calls: list[Any]) -> list[bytes]:
        out: list[bytes] = []
        for piece in tool_pieces(calls, len(self.calls)):
            item = self.calls.get(piece.index)
            if item is None:
                item = self.calls[piece.index] = {
                    "type": "function_call", "call_id": piece.call_id or f"call_{piece.index}",
                    "id": f"fc_{self.rid}_{piece.index}", "name": piece.name or "", "args": [],
                }  # fmt: skip
                out += self._start(item)
            if piece.arguments:
                item["args"].append(piece.arguments)
                if self.response is not None:
                    out.append(self._event("response.function_call_arguments.delta", {
                        "item_id": item["id"], "output_index": item["index"],
                        "delta": piece.arguments}))  # fmt: skip
        return out

    # ------------------------------------------------------------------ the relay

    def response_doc(self, status: str, m: Measured | None = None,
                     error: str | None = None) -> dict[str, Any]:  # fmt: skip
        b = self.body
        if status == "in_progress":
            output: list[dict[str, Any]] = []
        else:
            done = "completed" if status == "completed" else "incomplete"
            items = self.items or [{"type": "message", "id": f"msg_{self.rid}_0", "text": []}]
            output = [self._doc(i, done) for i in items]
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": {"code": "server_error", "message": error} if error else None,
            "incomplete_details": {"reason": INCOMPLETE.get(self.finish_reason or "",
                                                            "max_output_tokens")}
            if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "model": b.model, "output": output,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None, "store": False,
            "reasoning": b.reasoning if isinstance(b.reasoning, dict) and b.reasoning else None,
            "temperature": b.temperature, "top_p": b.top_p, "text": _text_echo(b.text),
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": b.tools or [], "truncation": "disabled", "user": b.user,
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
        await prepare(self.response, self.request)
        started = self.response_doc("in_progress")
        await write(self.response,
                    self._event("response.created", {"response": started})
                    + self._event("response.in_progress", {"response": started}))  # fmt: skip

    async def send(self, events: list[tuple[bytes, Chunk | None]]) -> None:
        parts: list[bytes] = []
        for d in deltas(events):
            if d.reasoning:
                parts += self._reasoning(d.reasoning)
            if d.text:
                parts += self._text(d.text)
            if d.tool_calls:
                parts += self._tool_calls(d.tool_calls)
            self.finish_reason = d.finish_reason or self.finish_reason
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
        status = self.status
        parts = [] if self.items else self._text_start_empty()
        parts += self._finish_open("completed" if status == "completed" else "incomplete")
        parts.append(self._event(f"response.{status}", {"response": self.response_doc(status, m)}))
        await write(self.response, b"".join(parts))

    def _text_start_empty(self) -> list[bytes]:
        """An answer with neither text nor a call: its (empty) message, opened now."""
        return self._start({"type": "message", "id": f"msg_{self.rid}_0", "text": []})

    def answer(self, m: Measured) -> dict[str, Any]:
        if self.finish_reason == "abort":
            return self.response_doc("failed", m, "the engine aborted the request")
        return self.response_doc(self.status, m)


def _text_echo(text: Any) -> dict[str, Any]:
    """The response's ``text``: the request's format (structured output), else plain text."""
    if isinstance(text, dict) and isinstance(text.get("format"), dict):
        return {"format": text["format"], "verbosity": text.get("verbosity") or "medium"}
    return {"format": {"type": "text"}, "verbosity": "medium"}
