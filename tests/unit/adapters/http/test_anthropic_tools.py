"""Anthropic tool use through the router: tools, tool_choice, tool_use and tool_result blocks
become the chat completion's tools and messages; the engine's streamed tool calls come back
as tool_use blocks (streamed: start, input_json_delta pieces, stop; whole: parsed input)."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from foretoken.adapters.http.router import anthropic_tools
from foretoken.adapters.http.router.anthropic import AnthropicRelay, Block, decode_messages
from foretoken.adapters.http.router.proxy import Measured
from foretoken.adapters.http.router.requests import RequestError
from tests.unit.adapters.http.engine_events import TOOL_TURN, Sink, delta

WEATHER = {"name": "weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
           "cache_control": {"type": "ephemeral"}}  # fmt: skip


def test_a_tool_loop_becomes_the_chat_completion_the_engine_expects() -> None:
    body = {
        "model": "m", "max_tokens": 50, "system": "sys", "tools": [WEATHER],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "-3 C"}]},
                {"type": "text", "text": "And tomorrow?"},
            ]},
        ],
    }  # fmt: skip
    _, transcript, upstream, chat = decode_messages(msgspec.json.encode(body))
    sent = json.loads(upstream)
    assert sent["tools"] == [{"type": "function", "function": {
        "name": "weather", "parameters": WEATHER["input_schema"],
        "description": "Weather of a city"}}]  # fmt: skip
    assert sent["tool_choice"] == "required" and sent["parallel_tool_calls"] is False
    assert sent["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "-3 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]  # fmt: skip
    assert chat["tools"] == sent["tools"]  # a chat template renders them too
    assert "<|tool|> -3 C" in transcript  # the simulated engines' transcript of it
    named = decode_messages(msgspec.json.encode(
        body | {"tool_choice": {"type": "tool", "name": "weather"}}))[2]  # fmt: skip
    assert json.loads(named)["tool_choice"] == {"type": "function",
                                                "function": {"name": "weather"}}  # fmt: skip


def test_streamed_tool_calls_are_tool_use_blocks() -> None:
    sink = Sink()
    relay = AnthropicRelay(None, sink, "msg_1", "m", 10)  # type: ignore[arg-type]

    async def run() -> None:
        await relay.send(TOOL_TURN)
        await relay.finish(Measured(output_tokens=9))

    asyncio.run(run())
    events = [json.loads(e.split("data: ", 1)[1]) for e in sink.data.decode().split("\n\n")
              if e.strip()]  # fmt: skip
    shape = [(e["type"], e.get("index")) for e in events]
    assert shape == [
        ("content_block_start", 0), ("ping", None), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1),
        ("content_block_delta", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2),
        ("message_delta", None), ("message_stop", None),
    ]  # fmt: skip
    assert events[4]["content_block"] == {"type": "tool_use", "id": "call_a",
                                          "name": "weather", "input": {}}  # fmt: skip
    pieces = "".join(e["delta"]["partial_json"] for e in events if e.get("index") == 1
                     and e["type"] == "content_block_delta")  # fmt: skip
    assert json.loads(pieces) == {"city": "Oslo"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_a_whole_answer_has_its_tool_use_blocks_with_their_input() -> None:
    relay = AnthropicRelay(None, None, "msg_1", "m", 10)  # type: ignore[arg-type]
    asyncio.run(relay.send(TOOL_TURN))
    answer = relay.answer(Measured(output_tokens=9))
    assert answer["stop_reason"] == "tool_use"
    assert answer["content"] == [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_a", "name": "weather", "input": {"city": "Oslo"}},
        {"type": "tool_use", "id": "call_b", "name": "time", "input": {}},
    ]  # fmt: skip


def _stream(turn: list[tuple[bytes, object]]) -> list[dict[str, object]]:
    sink = Sink()
    relay = AnthropicRelay(None, sink, "msg_1", "m", 10)  # type: ignore[arg-type]

    async def run() -> None:
        await relay.send(turn)  # type: ignore[arg-type]
        await relay.finish(Measured(output_tokens=9))

    asyncio.run(run())
    return [json.loads(e.split("data: ", 1)[1]) for e in sink.data.decode().split("\n\n")
            if e.strip()]  # fmt: skip


def test_an_answer_of_only_tool_calls_has_no_empty_text_block() -> None:
    """As Anthropic answers a forced tool call: ``content[0]`` is the tool_use block (an
    empty text block first broke ``content[0].input`` and is refused if sent back)."""
    turn = TOOL_TURN[1:]
    shape = [(e["type"], e.get("index")) for e in _stream(turn)]
    assert shape[:3] == [("content_block_start", 0), ("ping", None), ("content_block_delta", 0)]
    assert shape.count(("content_block_stop", 0)) == 1
    relay = AnthropicRelay(None, None, "msg_1", "m", 10)  # type: ignore[arg-type]
    asyncio.run(relay.send(turn))
    assert [b["type"] for b in relay.answer(Measured(output_tokens=9))["content"]] == [
        "tool_use", "tool_use"]  # fmt: skip
    empty = [(e["type"], e.get("index")) for e in _stream([delta({}, finish="stop")])]
    assert empty == [("content_block_start", 0), ("ping", None), ("content_block_stop", 0),
                     ("message_delta", None), ("message_stop", None)]  # fmt: skip


def test_blocks_as_the_sdk_dumps_them_and_errors_of_tools_are_taken() -> None:
    body = {
        "model": "m", "max_tokens": 5, "tools": [WEATHER],
        "system": [{"type": "text", "text": "sys"}, {"type": "text", "text": "sys2"}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "Here is the doc.",
                 "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "What is X?"}]},
            {"role": "assistant", "content": [  # model_dump() of the SDK's ToolUseBlock
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {},
                 "caller": None, "toolset_name": None}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "timeout",
                 "is_error": True}]},
        ],
    }  # fmt: skip
    upstream = json.loads(decode_messages(msgspec.json.encode(
        body | {"tools": [WEATHER | {"strict": True}]}))[2])  # fmt: skip
    assert upstream["tools"][0]["function"]["strict"] is True
    sent = upstream["messages"]
    parts = [{"type": "text", "text": t} for t in ("sys", "sys2")]
    assert sent[0] == {"role": "system", "content": parts}  # text parts, not "syssys2"
    assert sent[1]["content"] == [{"type": "text", "text": "Here is the doc."},
                                  {"type": "text", "text": "What is X?"}]  # fmt: skip
    assert sent[3] == {"role": "tool", "tool_call_id": "t1", "content": "Error: timeout"}


def test_a_tool_use_input_too_deep_to_write_as_arguments_is_named() -> None:
    """An input the body's decoder took that ``json.dumps`` cannot write (the stack is a few
    frames deeper there): a 400 naming it, not a RecursionError (a 500)."""
    deep: dict[str, object] = {}
    for _ in range(5000):
        deep = {"a": deep}
    block = Block(type="tool_use", id="t1", name="weather", input=deep)
    with pytest.raises(RequestError) as info:
        anthropic_tools.call(block, "messages[1].content[0]")
    assert info.value.status == 400 and info.value.param == "messages[1].content[0].input"
