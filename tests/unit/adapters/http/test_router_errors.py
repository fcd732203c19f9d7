"""What a client gets when its input breaks the router, or the router breaks: a JSON error in
its API's shape (OpenAI's for /v1/chat/completions and /v1/responses, Anthropic's for
/v1/messages), never aiohttp's text/plain 500 page. Before, a tool call's arguments with half
a character (a lone surrogate escape) reached the model's tokenizer and raised, arguments
nested 100,000 deep raised a RecursionError, and so did an Anthropic tool_use input just
under the body's depth limit; each was a text/plain 500."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import Tokenizer, models, pre_tokenizers

from foretoken.adapters.http.router import app as router_app
from foretoken.adapters.http.router import edge, errors
from tests.unit.adapters.http.router_app import MODEL, running_router

# prints the parsed tool-call arguments, as tool-calling models' templates do
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}"
            " {{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}")  # fmt: skip
HALF_EMOJI = '{"city": "Paris \\ud83d"}'  # valid JSON text; decoded, a lone surrogate
DEEP = "[" * 100_000 + "]" * 100_000


def _model(tmp_path: Path) -> dict[str, str]:
    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "user": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    return {"tokenizer": str(tmp_path / "tokenizer.json"),
            "chat_template": str(tmp_path / "chat.jinja")}  # fmt: skip


def _chat(arguments: str) -> tuple[str, dict[str, Any]]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                                           "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}  # fmt: skip


def _responses(arguments: str) -> tuple[str, dict[str, Any]]:
    return "/v1/responses", {"model": MODEL, "input": [
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}  # fmt: skip


@pytest.mark.parametrize(
    ("request_of", "arguments", "said"),
    [
        (_chat, HALF_EMOJI, "surrogate"),
        (_responses, HALF_EMOJI, "surrogate"),
        (_chat, DEEP, "nested too deeply"),
        (_responses, DEEP, "nested too deeply"),
    ],
)
async def test_tool_arguments_no_tokenizer_takes_are_an_openai_400(
    tmp_path: Path, request_of: Any, arguments: str, said: str
) -> None:
    path, body = request_of(arguments)
    async with running_router(**_model(tmp_path)) as client:
        resp = await client.post(path, json=body)
        assert resp.status == 400 and resp.content_type == "application/json"
        error = (await resp.json())["error"]
        assert said in error["message"] and error["type"] == "invalid_request_error"


async def test_a_tool_use_input_too_deep_to_write_is_an_anthropic_400() -> None:
    """The deepest input the body's decoder takes: one level more is the decoder's own 400
    (its limit is the interpreter's stack, as the encoder's, a few frames deeper, is)."""

    def body(depth: int) -> bytes:
        block = ('{"type":"tool_use","id":"t","name":"f","input":' + '{"a":' * depth + "{}"
                 + "}" * depth + "}")  # fmt: skip
        return (
            f'{{"model":"{MODEL}","max_tokens":2,"messages":[{{"role":"user","content":"x"}},'
            f'{{"role":"assistant","content":[{block}]}},{{"role":"user","content":'
            '[{"type":"tool_result","tool_use_id":"t","content":"ok"}]}]}'
        ).encode()

    async with running_router() as client:
        for depth in range(1000, 800, -1):
            resp = await client.post("/v1/messages", data=body(depth),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
            assert resp.content_type == "application/json", (depth, await resp.text())
            doc = await resp.json()
            if "body is nested too deeply" not in doc["error"]["message"]:
                break
        assert resp.status == 400 and doc["type"] == "error", doc
        assert doc["error"] == {
            "type": "invalid_request_error",
            "message": "messages[1].content[0].input is nested too deeply",
        }
        assert doc["request_id"] == resp.headers["request-id"]


async def test_an_unexpected_error_is_a_json_500_in_the_apis_shape(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(router_app, "check_model", broken)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    async with running_router() as client:
        with caplog.at_level(logging.ERROR, logger=errors.__name__):
            openai = await client.post("/v1/chat/completions", json=chat)
            anthropic = await client.post("/v1/messages", json=chat | {"max_tokens": 2})
        assert openai.status == 500 and openai.content_type == "application/json"
        error = (await openai.json())["error"]
        assert error["type"] == "api_error" and "ZeroDivisionError" in error["message"]
        assert openai.headers["x-request-id"]
        assert anthropic.status == 500 and anthropic.content_type == "application/json"
        doc = await anthropic.json()
        assert doc["type"] == "error" and doc["error"]["type"] == "api_error"
        assert doc["request_id"] == anthropic.headers["request-id"]
    logged = [r for r in caplog.records if r.name == errors.__name__]
    assert len(logged) == 2 and all(r.exc_info and r.exc_info[0] is ZeroDivisionError
                                    for r in logged)  # fmt: skip


async def test_an_error_after_a_stream_began_ends_the_connection() -> None:
    """Its bytes went out: no second answer is written into it (the client sees the stream
    end early), as aiohttp does without the middleware."""

    async def streams_then_breaks(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"data: {}\n\n")
        raise ZeroDivisionError("a bug mid-stream")

    app = web.Application(middlewares=[edge.request_ids, errors.json_http_errors])
    app.router.add_post("/v1/chat/completions", streams_then_breaks)
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/v1/chat/completions", data=msgspec.json.encode({}))
        assert resp.status == 200
        with pytest.raises(Exception):  # noqa: B017 (aiohttp's payload error, by version)
            await resp.read()
