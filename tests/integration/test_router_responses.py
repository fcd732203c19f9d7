"""OpenAI's Responses API through the router, driven by the official openai SDK (sync and
async, streamed and not, the SDK's own stream helper): what reaches the engine is the chat
completion the input says, the answer and the events have the shapes the SDK parses, and
what a stateless text-only router cannot honour is a 400 naming it. Real router process and
broker; the engines are the stub (which can echo the body it got)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from foretoken.settings import Settings
from tests.integration.stub_router import MODEL, StubRouter, stub_engines, stub_router

pytestmark = pytest.mark.integration
ECHO = "__stub_echo_body__"


@pytest.fixture(scope="module")
def router(
    kafka_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StubRouter]:
    with (
        stub_engines(tmp_path_factory.mktemp("stub")) as engines,
        stub_router(kafka_settings, tmp_path_factory.mktemp("router"), engines) as r,
    ):
        yield r
    assert "Traceback" not in r.log_text()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)


def test_a_response_has_the_shape_the_sdk_reads_and_the_engine_gets_the_chat(
    router: StubRouter,
) -> None:
    r = _client(router.url).responses.create(  # type: ignore[call-overload]
        model=MODEL, instructions="be brief", max_output_tokens=3, temperature=0.5, user="u-1",
        input=[{"role": "developer", "content": "dev"},
               {"role": "user", "content": [{"type": "input_text", "text": ECHO}]},
               {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
               {"type": "message", "role": "user", "content": "again"}],
        metadata={"k": "v"}, store=False, tool_choice="auto", extra_body={"cache_salt": "t-1"},
    )  # fmt: skip
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status in ("completed", "incomplete") and r.metadata == {"k": "v"}
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    sent = json.loads(r.output_text)  # the stub echoes the body it got
    assert sent["messages"] == [
        {"role": "system", "content": "be brief\n\ndev"},  # one system message
        {"role": "user", "content": [{"type": "text", "text": ECHO}]},  # parts stay parts
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
        {"role": "user", "content": "again"},
    ]  # fmt: skip
    assert sent["max_tokens"] == 3 and sent["temperature"] == 0.5 and sent["user"] == "u-1"
    assert sent["stream"] is True and sent["cache_salt"] == "t-1"
    assert r.usage is not None and r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cache_write_tokens == 0


def test_a_short_limit_is_an_incomplete_response(router: StubRouter) -> None:
    r = _client(router.url).responses.create(model=MODEL, input="hello", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens" and r.output_text


def test_the_stream_helper_and_raw_events(router: StubRouter) -> None:
    client = _client(router.url)
    with client.responses.stream(model=MODEL, input="hi") as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    # the stub ends every answer at its length: the last event is response.incomplete
    final = events[-1].response  # type: ignore[union-attr]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1 and kinds[4 : 4 + deltas] == ["response.output_text.delta"] * deltas
    assert kinds[4 + deltas :] == ["response.output_text.done", "response.content_part.done",
                                   "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert final.output_text and final.usage is not None and final.usage.output_tokens == deltas
    body = {"model": MODEL, "input": "hi", "stream": True, "max_output_tokens": 2}
    with httpx.stream("POST", router.url + "/v1/responses", timeout=30, json=body) as resp:
        assert resp.status_code == 200 and resp.headers["x-request-id"]
        raw = [e for e in resp.read().decode().split("\n\n") if e.strip()]
    docs = [json.loads(e.split("data: ", 1)[1]) for e in raw]
    assert [d["sequence_number"] for d in docs] == list(range(len(raw)))
    assert docs[-1]["type"] == "response.incomplete"  # max_output_tokens cut it
    assert docs[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_the_async_client_streams(router: StubRouter) -> None:
    async def run() -> str:
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
        text = ""
        async for event in await client.responses.create(model=MODEL, input="hi",
                                                         stream=True):  # fmt: skip
            if event.type == "response.output_text.delta":
                text += event.delta
        await client.close()
        return text

    assert asyncio.run(run())


@pytest.mark.parametrize(("fields", "names"), [
    ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"seed": 3}, "seed"),
    ({"store": True}, "store"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
])  # fmt: skip
def test_what_cannot_be_honoured_is_a_400_naming_it(
    router: StubRouter, fields: dict[str, Any], names: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "input": "hi"}
    given = {k: v for k, v in fields.items() if k != "seed"}
    with pytest.raises(openai.BadRequestError) as info:
        _client(router.url).responses.create(
            **body | given,  # type: ignore[call-overload]
            extra_body={"seed": 3} if "seed" in fields else None,
        )
    err = info.value.body
    assert isinstance(err, dict) and err.get("param") == names, err


def test_function_tools_and_a_tool_loop_reach_the_engine(router: StubRouter) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    tool = {"type": "function", "name": "weather", "description": "d", "parameters": schema}
    r = _client(router.url).responses.create(  # type: ignore[call-overload]
        model=MODEL, tools=[tool], tool_choice={"type": "function", "name": "weather"},
        input=[{"role": "user", "content": "weather?"},
               {"type": "function_call", "call_id": "call_1", "name": "weather",
                "arguments": '{"city": "x"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
               {"role": "user", "content": ECHO}],
    )  # fmt: skip
    sent = json.loads(r.output_text)
    assert sent["tools"] == [{"type": "function", "function": {
        "name": "weather", "description": "d", "parameters": tool["parameters"]}}]  # fmt: skip
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "tool", "user"]
    assert sent["messages"][1]["tool_calls"][0]["id"] == "call_1"
    assert sent["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


def test_structured_output_is_the_engines_response_format(router: StubRouter) -> None:
    """``text.format`` (what ``responses.parse(text_format=...)`` sends) becomes the chat
    completion's ``response_format``: the engine's guided decoding, not a 400."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "name": "A", "schema": schema, "strict": True}
    r = _client(router.url).responses.create(  # type: ignore[call-overload]
        model=MODEL, input=ECHO, text={"format": fmt}
    )
    assert json.loads(r.output_text)["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "A", "schema": schema, "strict": True},
    }
    assert r.text.format.type == "json_schema"  # echoed as asked
    r = _client(router.url).responses.create(  # type: ignore[call-overload]
        model=MODEL, input=ECHO, text={"format": {"type": "json_object"}}
    )
    assert json.loads(r.output_text)["response_format"] == {"type": "json_object"}


def test_nothing_asked_is_taken(router: StubRouter) -> None:
    client = _client(router.url)
    extras: list[dict[str, Any]] = [
        {"tools": []}, {"tool_choice": "none"}, {"text": {"format": {"type": "text"}}},
        {"truncation": "disabled"}, {"include": []}, {"parallel_tool_calls": False},
        {"store": False},
        {"input": [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                   {"role": "user", "content": "x"}]},
    ]  # fmt: skip
    for extra in extras:
        body = {"model": MODEL, "input": "x", "max_output_tokens": 1} | extra
        assert client.responses.create(**body).output_text  # type: ignore[call-overload]


def test_a_reasoning_models_reasoning_is_a_reasoning_item(router: StubRouter) -> None:
    """The engine's reasoning_content as a reasoning item before the message, whole and
    streamed (the SDK's stream accumulator checks the events); reasoning settings reach the
    engine; an earlier answer's reasoning item sent back is taken."""
    client = _client(router.url)
    ask = {"model": MODEL, "input": "__stub_reasoning__",
           "reasoning": {"effort": "high", "summary": "auto"},
           "include": ["reasoning.encrypted_content"]}  # fmt: skip
    r = client.responses.create(**ask)  # type: ignore[call-overload]
    assert [item.type for item in r.output] == ["reasoning", "message"]
    thought = r.output[0]
    assert thought.type == "reasoning" and thought.content is not None
    assert thought.content[0].text == "Let me think. Done." and thought.summary == []
    assert r.output_text == "Answer." and r.reasoning is not None
    assert r.reasoning.effort == "high"
    with client.responses.stream(**ask) as stream:  # type: ignore[call-overload]
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].model_dump(exclude={"id"}) == thought.model_dump(exclude={"id"})
    assert final.output_text == "Answer."
    echoed = json.loads(client.responses.create(  # type: ignore[call-overload]
        model=MODEL, reasoning={"effort": "low"},
        input=[{"role": "user", "content": "hi"}, thought.model_dump(exclude_none=True),
               {"role": "user", "content": ECHO}]).output_text)  # fmt: skip
    assert echoed["reasoning_effort"] == "low"
    assert [m["role"] for m in echoed["messages"]] == ["user", "user"]


def test_instructions_and_a_developer_item_are_one_system_message(router: StubRouter) -> None:
    """Chat templates refuse a second system message: instructions and leading
    system/developer items reach the engine as one."""
    r = _client(router.url).responses.create(  # type: ignore[call-overload]
        model=MODEL, instructions="be brief",
        input=[{"role": "developer", "content": "use metric"}, {"role": "user", "content": ECHO}],
    )  # fmt: skip
    sent = json.loads(r.output_text)["messages"]
    assert sent[0] == {"role": "system", "content": "be brief\n\nuse metric"}
    assert [m["role"] for m in sent] == ["system", "user"]
