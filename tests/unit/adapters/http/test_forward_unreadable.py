"""An engine answer the router cannot read breaks the answer off as an engine error — the
client hears of it and the completion is published — instead of a 500 that leaves the
grant without an outcome. A streamed tool-call delta of an odd shape is merged as far as it
makes sense. An answer vLLM aborted (``finish_reason: "abort"``) is an error, not a served
request (Anthropic's clients then get an error event, not ``end_turn``)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from foretoken.adapters.http.router.proxy import Chunk, Collected, forward

EVENTS = [
    b'{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":"hi"}}]}',
    b'{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"tool_calls":'
    b'[{"index":null,"id":7,"function":"f"},{"index":0,"function":{"name":"w","arguments":3}},'
    b'{"index":0,"function":{"arguments":"{}"}}]},"finish_reason":"tool_calls"}]}',
]

ABORTED = (
    b'{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},'
    b'"finish_reason":"abort"}]}'
)


async def _engine(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in EVENTS if request.query.get("abort") is None else [*EVENTS[:1], ABORTED]:
        await response.write(b"data: " + event + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    return response


class _Breaks:
    """A relay that cannot take the tool calls' event."""

    def __init__(self) -> None:
        self.batches, self.closed_with = 0, "not closed"

    async def open(self) -> None:
        return None

    async def send(self, events: list[tuple[bytes, Chunk | None]]) -> None:
        self.batches += 1
        if any(b"tool_calls" in payload for payload, _ in events):
            raise TypeError("int() argument must be a string, not 'NoneType'")

    async def close(self, error: str | None) -> None:
        self.closed_with = error or ""


async def _forward(relay: Any, path: str = "/v1/chat/completions") -> Any:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _engine)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        return await forward(session, str(server.make_url(path)), b"{}", {},
                             relay, lambda _: None, aiohttp.ClientTimeout(total=10))  # fmt: skip


def test_an_event_no_relay_can_take_is_an_engine_error_not_an_exception() -> None:
    relay = _Breaks()
    measured = asyncio.run(_forward(relay))
    assert measured.status == "error" and measured.engine_status == 200
    assert measured.error.startswith("engine answer unreadable: TypeError")
    assert relay.closed_with == measured.error  # the client's answer says so


def test_odd_tool_call_deltas_are_merged_as_far_as_they_make_sense() -> None:
    collected = Collected(chat=True)
    measured = asyncio.run(_forward(collected))
    assert measured.status == "ok", measured.error
    calls = collected.answer("m", "r")["choices"][0]["message"]["tool_calls"]
    # the call without an index opened call 0; the others named it and added to it
    assert [c["function"] for c in calls] == [{"name": "w", "arguments": "{}"}]


def test_an_answer_the_engine_aborted_is_an_error_not_a_served_request() -> None:
    measured = asyncio.run(_forward(Collected(chat=True), "/v1/chat/completions?abort=1"))
    assert measured.status == "error" and "aborted" in (measured.error or "")
    assert measured.first_token_s is not None  # its first token came: its TTFT is measured
