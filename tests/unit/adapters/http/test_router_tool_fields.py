"""Tool definitions and chat content the translating APIs take: every field of an Anthropic
custom tool, of its ``tool_choice`` and of a Responses function tool reaches the engine or
is refused with a 400 naming it — never dropped (``defer_loading: true`` would put a tool
in the prompt that the client kept out of it) — and what the SDKs type as valid (a tool's
``type: null``) is taken. A chat message's bare string among its parts is text, as vLLM
takes it."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from foretoken.adapters.http.router.anthropic import decode_count_tokens, decode_messages
from foretoken.adapters.http.router.requests import RequestError, decode_openai
from foretoken.adapters.http.router.responses import decode_responses

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = {"name": "weather", "input_schema": SCHEMA}


def _messages(**fields: Any) -> dict[str, Any]:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    return dict(json.loads(decode_messages(msgspec.json.encode(body | fields))[2]))


@pytest.mark.parametrize("tool", [
    TOOL | {"type": None}, TOOL | {"type": "custom"}, TOOL | {"defer_loading": False},
    TOOL | {"input_examples": []}, TOOL | {"allowed_callers": ["direct"]},
    TOOL | {"eager_input_streaming": True, "cache_control": {"type": "ephemeral"}},
    TOOL | {"description": None, "strict": None},
])  # fmt: skip
def test_anthropic_tool_fields_that_ask_for_nothing_are_taken(tool: dict[str, Any]) -> None:
    sent = _messages(tools=[tool])["tools"]
    assert sent == [{"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}]


@pytest.mark.parametrize(("tool", "param"), [
    (TOOL | {"defer_loading": True}, "tools[0].defer_loading"),
    (TOOL | {"input_examples": [{"city": "Oslo"}]}, "tools[0].input_examples"),
    (TOOL | {"allowed_callers": ["code_execution_20250825"]}, "tools[0].allowed_callers"),
    (TOOL | {"descripton": "typo"}, "tools[0].descripton"),
    (TOOL | {"description": 5}, "tools[0].description"),
    (TOOL | {"strict": "yes"}, "tools[0].strict"),
])  # fmt: skip
def test_anthropic_tool_fields_not_handled_are_refused(tool: dict[str, Any], param: str) -> None:
    for decode, extra in ((decode_messages, {"max_tokens": 5}), (decode_count_tokens, {})):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
        with pytest.raises(RequestError) as info:
            decode(msgspec.json.encode(body | extra))
        assert info.value.status == 400 and info.value.param == param


def test_anthropic_tool_choice_fields_are_taken_or_refused() -> None:
    sent = _messages(tools=[TOOL], tool_choice={"type": "tool", "name": "weather",
                                                "disable_parallel_tool_use": False})  # fmt: skip
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    for choice, param in (({"type": "auto", "nme": "weather"}, "tool_choice.nme"),
                          ({"type": "none", "name": "weather"}, "tool_choice.name"),
                          ({"type": "any", "disable_parallel_tool_use": "yes"},
                           "tool_choice.disable_parallel_tool_use")):  # fmt: skip
        with pytest.raises(RequestError) as info:
            _messages(tools=[TOOL], tool_choice=choice)
        assert info.value.param == param


FUNCTION = {"type": "function", "name": "f", "parameters": SCHEMA, "strict": None}


def _responses(tool: dict[str, Any]) -> Any:
    body = {"model": "m", "input": "hi", "tools": [tool]}
    return json.loads(decode_responses(msgspec.json.encode(body))[2])["tools"]


def test_responses_function_tool_fields_are_taken_or_refused() -> None:
    for tool in (FUNCTION, FUNCTION | {"defer_loading": False, "description": "d"}):
        assert _responses(tool)[0]["function"]["parameters"] == SCHEMA
    refused: tuple[tuple[dict[str, Any], str], ...] = (
        (FUNCTION | {"defer_loading": True}, "tools[0].defer_loading"),
        (FUNCTION | {"paramters": SCHEMA}, "tools[0].paramters"),
        (FUNCTION | {"description": 5}, "tools[0].description"),
        (FUNCTION | {"parameters": "{}"}, "tools[0].parameters"),
    )
    for tool, param in refused:
        with pytest.raises(RequestError) as info:
            _responses(tool)
        assert info.value.status == 400 and info.value.param == param


def test_a_bare_string_among_the_parts_is_text_and_reaches_the_engine() -> None:
    content: list[Any] = ["hello", {"type": "text", "text": " there"}]
    raw = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": content}]})
    d = decode_openai(raw, True, 100)
    assert d.text is not None and "hello there" in d.text
    assert json.loads(d.upstream)["messages"][0]["content"] == content
    with pytest.raises(RequestError) as info:  # still: a part that is neither
        decode_openai(raw.replace(b'"hello"', b"5"), True, 100)
    assert info.value.param == "messages[0].content[0]"
