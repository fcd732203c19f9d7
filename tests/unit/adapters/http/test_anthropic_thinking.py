"""Anthropic extended thinking through the router: ``thinking`` checked as Anthropic checks
it; a reasoning model's reasoning (the engine's ``reasoning_content`` / ``reasoning``) comes
back as a ``thinking`` block before the text and the tool calls — streamed with its
``thinking_delta`` pieces and a ``signature_delta`` — only when the request enabled it;
an earlier answer's thinking blocks are left out of the context."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest

from foretoken.adapters.http.router.anthropic import (
    AnthropicRelay,
    decode_count_tokens,
    decode_messages,
)
from foretoken.adapters.http.router.proxy import Measured
from foretoken.adapters.http.router.requests import RequestError
from tests.unit.adapters.http.engine_events import TOOL_TURN, Sink, delta

THINKING = {"type": "enabled", "budget_tokens": 1024}
REASONING = [
    delta({"role": "assistant", "reasoning_content": "Oslo is "}),
    delta({"reasoning_content": "cold."}),
    delta({"reasoning": "", "content": "It is "}),
    delta({"content": "cold."}),
    delta({}, finish="stop"),
]


def _run(turn: list[Any], thinking: bool, stream: bool) -> tuple[AnthropicRelay, list[Any]]:
    sink = Sink() if stream else None
    relay = AnthropicRelay(None, sink, "msg_1", "m", 10, thinking=thinking)  # type: ignore[arg-type]

    async def run() -> None:
        await relay.send(turn)
        if sink is not None:
            await relay.finish(Measured(output_tokens=9))

    asyncio.run(run())
    if sink is None:
        return relay, []
    events = [json.loads(e.split("data: ", 1)[1]) for e in sink.data.decode().split("\n\n")
              if e.strip()]  # fmt: skip
    return relay, events


def test_reasoning_is_a_thinking_block_before_the_text() -> None:
    _, events = _run(REASONING, thinking=True, stream=True)
    shape = [(e["type"], e.get("index"), e.get("delta", {}).get("type")) for e in events]
    assert shape == [
        ("content_block_start", 0, None), ("ping", None, None),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, None), ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("message_delta", None, None), ("message_stop", None, None),
    ]  # fmt: skip
    assert events[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    signature = events[4]["delta"]["signature"]
    relay, _ = _run(REASONING, thinking=True, stream=False)
    assert relay.answer(Measured(output_tokens=9))["content"] == [
        {"type": "thinking", "thinking": "Oslo is cold.", "signature": signature},
        {"type": "text", "text": "It is cold."},
    ]  # fmt: skip


def test_without_thinking_enabled_the_reasoning_is_not_shown() -> None:
    _, events = _run(REASONING, thinking=False, stream=True)
    assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"] == [
        "text"]  # fmt: skip
    relay, _ = _run(REASONING, thinking=False, stream=False)
    assert relay.answer(Measured())["content"] == [{"type": "text", "text": "It is cold."}]


def test_thinking_then_tool_calls_and_thinking_alone() -> None:
    turn = [delta({"reasoning_content": "I need the weather."}), *TOOL_TURN[1:]]
    _, events = _run(turn, thinking=True, stream=True)
    starts = [(e["index"], e["content_block"]["type"]) for e in events
              if e["type"] == "content_block_start"]  # fmt: skip
    assert starts == [(0, "thinking"), (1, "tool_use"), (2, "tool_use")]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1, 2]
    kinds = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert kinds.index("signature_delta") < kinds.index("input_json_delta")
    relay, _ = _run(turn, thinking=True, stream=False)
    assert [b["type"] for b in relay.answer(Measured())["content"]] == [
        "thinking", "tool_use", "tool_use"]  # fmt: skip
    alone = [delta({"reasoning_content": "hmm"}), delta({}, finish="length")]
    _, events = _run(alone, thinking=True, stream=True)
    assert [(e["type"], e.get("index")) for e in events][-4:] == [
        ("content_block_delta", 0), ("content_block_stop", 0), ("message_delta", None),
        ("message_stop", None)]  # fmt: skip
    relay, _ = _run(alone, thinking=True, stream=False)
    assert [b["type"] for b in relay.answer(Measured())["content"]] == ["thinking"]


def _body(**fields: Any) -> bytes:
    return msgspec.json.encode(
        {"model": "m", "max_tokens": 2048, "messages": [{"role": "user", "content": "hi"}]} | fields
    )


def test_thinking_is_checked_as_anthropic_checks_it() -> None:
    for ok in (THINKING, {"type": "adaptive"}, {"type": "disabled"}):
        assert json.loads(decode_messages(_body(thinking=ok))[2])["messages"][-1] == {
            "role": "user", "content": "hi"}  # fmt: skip
    bad = [
        ({"type": "enabled"}, "thinking.budget_tokens"),
        ({"type": "enabled", "budget_tokens": 100}, "thinking.budget_tokens"),
        ({"type": "enabled", "budget_tokens": 4096}, "thinking.budget_tokens"),  # ≥ max_tokens
        ({"type": "on"}, "thinking.type"),
        ({"type": "adaptive", "budget_tokens": 2000}, "thinking.budget_tokens"),
        ("yes", "thinking.type"),
    ]
    for value, param in bad:
        with pytest.raises(RequestError) as info:
            decode_messages(_body(thinking=value))
        assert info.value.status == 400 and info.value.param == param, value


def test_thinking_display_is_taken_with_the_values_the_sdk_types() -> None:
    """``display`` (the SDK's ThinkingConfigEnabledParam / ThinkingConfigAdaptiveParam) was
    refused as an unknown field. Taken: the engine's reasoning is what it is."""
    for display in ("summarized", "omitted", None):
        for thinking in (THINKING, {"type": "adaptive"}):
            body, _, upstream, _ = decode_messages(_body(thinking=thinking | {"display": display}))
            assert "display" not in json.loads(upstream) and body.thinking["display"] == display
    for value in ({"type": "enabled", "budget_tokens": 1024, "display": "full"},
                  {"type": "adaptive", "display": 1},
                  {"type": "disabled", "display": "omitted"}):  # fmt: skip
        with pytest.raises(RequestError) as info:
            decode_messages(_body(thinking=value))
        assert info.value.status == 400 and info.value.param == "thinking.display", value
    counted = msgspec.json.encode(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "adaptive", "display": "omitted"},
        }
    )
    decode_count_tokens(counted)


def test_an_earlier_answers_thinking_blocks_are_left_out_of_the_context() -> None:
    turns = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Oslo is cold.", "signature": "abc"},
            {"type": "redacted_thinking", "data": "xyz"},
            {"type": "text", "text": "Cold."}]},
        {"role": "user", "content": "Tomorrow?"},
    ]  # fmt: skip
    sent = json.loads(decode_messages(_body(messages=turns, thinking=THINKING))[2])
    assert sent["messages"] == [{"role": "user", "content": "Weather?"},
                                {"role": "assistant", "content": "Cold."},
                                {"role": "user", "content": "Tomorrow?"}]  # fmt: skip
    user_thinking = [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]
    with pytest.raises(RequestError):
        decode_messages(_body(messages=user_thinking))
