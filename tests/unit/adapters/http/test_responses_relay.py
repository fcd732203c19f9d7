"""The Responses API's output items from an engine's chat completion stream: a message at
the first text, a function_call item per tool call (the one before closed first), their
events in order with one sequence, and the same items in a whole answer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec

from foretoken.adapters.http.router.proxy import Measured
from foretoken.adapters.http.router.responses import decode_responses
from foretoken.adapters.http.router.responses_relay import ResponsesRelay
from tests.unit.adapters.http.engine_events import TOOL_TURN, Sink


def _body() -> Any:
    tools = [{"type": "function", "name": "weather"}, {"type": "function", "name": "time"}]
    raw = msgspec.json.encode({"model": "m", "input": "hi", "tools": tools})
    return decode_responses(raw)[0]


def test_streamed_items_follow_one_another_with_their_events() -> None:
    sink = Sink()
    relay = ResponsesRelay(None, sink, _body(), "r1", 10)  # type: ignore[arg-type]

    async def run() -> None:
        await relay.send(TOOL_TURN)
        await relay.finish(Measured(output_tokens=9))

    asyncio.run(run())
    docs = [json.loads(e.split("data: ", 1)[1]) for e in sink.data.decode().split("\n\n")
            if e.strip()]  # fmt: skip
    assert [d["sequence_number"] for d in docs] == list(range(len(docs)))
    kinds = [(d["type"], d.get("output_index")) for d in docs]
    assert kinds == [
        ("response.output_item.added", 0), ("response.content_part.added", 0),
        ("response.output_text.delta", 0), ("response.output_text.done", 0),
        ("response.content_part.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.done", 1), ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2), ("response.output_item.done", 2),
        ("response.completed", None),
    ]  # fmt: skip
    assert docs[9]["arguments"] == '{"city":"Oslo"}' and docs[9]["name"] == "weather"
    final = docs[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call", "function_call"]
    assert final["output"][1]["call_id"] == "call_a" and final["output"][2]["arguments"] == "{}"


def test_a_whole_answer_has_the_same_items_and_an_empty_one_a_message() -> None:
    relay = ResponsesRelay(None, None, _body(), "r1", 10)  # type: ignore[arg-type]
    asyncio.run(relay.send(TOOL_TURN))
    out = relay.answer(Measured(output_tokens=9))["output"]
    assert out[0]["content"][0]["text"] == "Checking."
    assert [(o["type"], o["status"]) for o in out] == [
        ("message", "completed"),
        ("function_call", "completed"),
        ("function_call", "completed"),
    ]
    empty = ResponsesRelay(None, None, _body(), "r2", 10)  # type: ignore[arg-type]
    only = empty.answer(Measured(output_tokens=0))["output"]
    assert [o["type"] for o in only] == ["message"] and only[0]["content"][0]["text"] == ""
