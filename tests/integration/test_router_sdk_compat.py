"""The router driven by the official openai and anthropic SDKs (and raw HTTP) with
unusual-but-valid requests: what each SDK and the benchmark tools send reaches the engine
untouched or is refused with a 4xx in the API's own shape, the streamed and whole answers
have the shapes the SDKs parse, and every error (404, 405, 415, bad JSON, empty body, a
wrong key) is in the shape of the API called, with a request id. Real router processes and
broker; the engines are the stub (which can echo the body it got); the simulated fleet's
are in test_router_sim_fleet.py."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import msgspec
import openai
import pytest
from tokenizers import Tokenizer as HFTokenizers

from foretoken.adapters.engines.engines_file import dump_engines, load_engines
from foretoken.bench.engine_stub import engines_file as engines_file_text
from foretoken.settings import Settings
from tests.conftest import free_port
from tests.integration.stub_router import MODEL, StubRouter, stub_engines, stub_router
from tests.unit.adapters.http.test_chat_template import LLAMA, _model_dir

pytestmark = pytest.mark.integration
ECHO = "__stub_echo_body__"


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with stub_engines(tmp_path_factory.mktemp("stub")) as path:
        yield path


@pytest.fixture(scope="module")
def router(
    kafka_settings: Settings, tmp_path_factory: pytest.TempPathFactory, engines: Path
) -> Iterator[StubRouter]:
    with stub_router(kafka_settings, tmp_path_factory.mktemp("router"), engines) as r:
        yield r
    assert "Traceback" not in r.log_text()


def _openai(url: str, key: str = "k") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def _anthropic(url: str, key: str = "k") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)


def _sent(text: str | None) -> dict[str, Any]:
    """The body the stub engine got, from the text it answered."""
    return dict(json.loads(text or "{}"))


# ---------------------------------------------------------------------------- OpenAI


def test_openai_chat_fields_reach_the_engine(router: StubRouter) -> None:
    messages: list[Any] = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "name": "bob", "content": [{"type": "text", "text": ECHO}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]  # fmt: skip
    tools: list[Any] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    reply = _openai(router.url).chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=3, seed=7, stop="END",
        user="u-1", metadata={"k": "v"}, parallel_tool_calls=False, tools=tools,
        tool_choice="auto", response_format={"type": "json_object"}, logprobs=True,
        top_logprobs=2, temperature=0.0,
    )  # fmt: skip
    assert reply.object == "chat.completion" and reply.id and reply.created >= 0
    assert reply.model == MODEL and reply.choices[0].message.role == "assistant"
    sent = _sent(reply.choices[0].message.content)
    assert sent["messages"] == messages and sent["max_completion_tokens"] == 3
    assert sent["seed"] == 7 and sent["stop"] == "END" and sent["user"] == "u-1"
    assert sent["metadata"] == {"k": "v"} and sent["parallel_tool_calls"] is False
    assert sent["tools"] == tools and sent["response_format"] == {"type": "json_object"}
    assert sent["logprobs"] is True and sent["top_logprobs"] == 2
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("include_usage", [True, False, None])
def test_the_usage_chunk_comes_only_when_asked(
    router: StubRouter, include_usage: bool | None
) -> None:
    options: Any = {} if include_usage is None else {"stream_options": {
        "include_usage": include_usage}}  # fmt: skip
    chunks = list(_openai(router.url).chat.completions.create(
        model=MODEL, max_tokens=2, stream=True, messages=[{"role": "user", "content": "hi"}],
        **options,
    ))  # fmt: skip
    assert all(c.object == "chat.completion.chunk" for c in chunks)  # the usage chunk too
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = [c for c in chunks if c.usage is not None]
    if include_usage:
        assert len(usage) == 1 and usage[0] is chunks[-1] and not chunks[-1].choices
    else:
        assert not usage


def test_every_choice_of_n_starts_with_the_role(router: StubRouter) -> None:
    chunks = [c for c in _openai(router.url).chat.completions.create(
        model=MODEL, max_tokens=1, n=2, stream=True,
        messages=[{"role": "user", "content": ECHO}],
    ) if c.choices]  # fmt: skip
    first: dict[int, str | None] = {}
    for c in chunks:
        first.setdefault(c.choices[0].index, c.choices[0].delta.role)
    assert first == {0: "assistant", 1: "assistant"}


def test_completion_prompts_in_every_shape(router: StubRouter) -> None:
    c = _openai(router.url)
    for prompt in ("hello", ["hello"], [16, 17, 18], [[16, 17, 18]]):
        reply = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert reply.object == "text_completion" and reply.choices[0].text == " tok tok"
    sent = _sent(c.completions.create(
        model=MODEL, prompt=[ECHO], max_tokens=1, echo=True, logprobs=1, suffix="!", best_of=1,
    ).choices[0].text)  # fmt: skip
    assert sent["prompt"] == ECHO and sent["echo"] is True and sent["logprobs"] == 1
    assert sent["suffix"] == "!" and sent["best_of"] == 1
    for bad, param in (([[1, 2], []], "prompt[1]"), (["a", ""], "prompt[1]")):
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model=MODEL, prompt=bad, max_tokens=1)
        assert info.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="best_of"):
        c.completions.create(model=MODEL, prompt="x", max_tokens=1, best_of=3)


def test_a_batch_of_prompts_is_answered_as_openai_answers_it(router: StubRouter) -> None:
    """Each prompt goes to an engine as its own request; the answer has prompt i's n choices
    at i·n …, the usage summed; streamed, every choice's events and one usage event."""
    c = _openai(router.url)
    reply = c.completions.create(model=MODEL, prompt=[ECHO + " one", ECHO, ECHO + " two"],
                                 max_tokens=2, n=2)  # fmt: skip
    assert [ch.index for ch in reply.choices] == list(range(6))
    assert _sent(reply.choices[0].text)["prompt"] == ECHO + " one"  # its own prompt
    assert _sent(reply.choices[4].text)["prompt"] == ECHO + " two"
    assert _sent(reply.choices[2].text)["prompt"] == ECHO
    two = c.completions.create(model=MODEL, prompt=[[16, 17], [18]], max_tokens=3)
    assert [ch.text for ch in two.choices] == [" tok tok tok"] * 2
    assert two.usage is not None and two.usage.completion_tokens == 6  # summed
    texts: dict[int, str] = {}
    usages = []
    for chunk in c.completions.create(
        model=MODEL,
        prompt=["a", "b", "c"],
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    ):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
        if chunk.usage is not None:
            usages.append(chunk.usage)
    assert texts == {0: " tok tok", 1: " tok tok", 2: " tok tok"}
    assert len(usages) == 1 and usages[0].completion_tokens == 6
    raw = httpx.post(router.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": ["x"] * 257, "max_tokens": 1})  # fmt: skip
    assert raw.status_code == 400 and "max_batch_prompts" in raw.json()["error"]["message"]


def _served(router: StubRouter) -> list[int]:
    """Requests each stub engine has answered (its /metrics)."""
    out = []
    for engine in load_engines(router.engines_file):
        text = httpx.get(engine.http_url + "/metrics", timeout=10).text
        out.append(int(text.split("foretoken_stub_requests_total ")[1].split()[0]))
    return out


def test_a_batch_is_spread_and_fails_as_one(router: StubRouter) -> None:
    """The router deciding alone spreads a batch's prompts as it spreads separate requests;
    one prompt its engine refuses is the batch's answer, in the engine's own status."""
    before = _served(router)
    c = _openai(router.url)
    c.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2)
    after = _served(router)
    assert [b - a for a, b in zip(before, after, strict=True)] == [1, 1]  # one each
    with pytest.raises(openai.BadRequestError, match="stub refuses"):
        c.completions.create(model=MODEL, prompt=["a", "__stub_refuse__"], max_tokens=2)
    body = {"model": MODEL, "prompt": ["__stub_slow__", "__stub_refuse__"], "stream": True}
    streamed = httpx.post(router.url + "/v1/completions", timeout=30, json=body)
    if streamed.status_code == 200:  # the slow one's stream began first: an error event
        assert "stub refuses" in streamed.text and streamed.text.endswith("data: [DONE]\n\n")
    else:
        assert streamed.status_code == 400 and "stub refuses" in streamed.text


def test_nulls_where_openai_takes_them(router: StubRouter) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "n": None, "stream": None,
            "echo": None, "stream_options": None, "logprobs": None, "stop": None}  # fmt: skip
    answer = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == " tok"


def test_engine_endpoints_that_generate_nothing_pass_through(
    router: StubRouter, kafka_settings: Settings, tmp_path: Path
) -> None:
    """Embeddings, tokenize, scores …: the body reaches an engine of the model untouched, in
    turn among idle engines; its answer (status and body) comes back as it is."""
    body = b'{"model": "stub-model", "input": ["a", "b"], "encoding_format": "float", "x": 1}'
    seen = []
    for _ in range(2):
        r = httpx.post(router.url + "/v1/embeddings", content=body, timeout=30,
                       headers={"Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == 200 and r.headers["x-request-id"], r.text
        got = r.json()
        assert got["stub_path"] == "/v1/embeddings" and got["stub_body"] == body.decode()
        seen.append(got["stub_port"])
    assert len(set(seen)) == 2  # one each
    for path in ("/tokenize", "/detokenize", "/v1/rerank", "/score", "/pooling", "/classify"):
        r = httpx.post(router.url + path, json={"prompt": "hi"}, timeout=30)  # no model: the one
        assert r.status_code == 200 and r.json()["stub_path"] == path, (path, r.text)
    refused = httpx.post(router.url + "/v1/embeddings", timeout=30,
                         json={"model": MODEL, "input": "__stub_refuse__"})  # fmt: skip
    assert refused.status_code == 400 and "__stub_refuse__" in refused.json()["stub_body"]
    unknown = httpx.post(router.url + "/v1/embeddings", json={"model": "nope"}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    bad = httpx.post(router.url + "/tokenize", content=b"{", timeout=30,
                     headers={"Content-Type": "application/json"})  # fmt: skip
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    dead = tmp_path / "dead.toml"  # an engine that is not there: a 502 in OpenAI's shape
    dead.write_text(engines_file_text([free_port()], MODEL))
    with stub_router(kafka_settings, tmp_path, dead) as down:
        gone = httpx.post(down.url + "/v1/embeddings", json={"model": MODEL, "input": "a"},
                          timeout=30)  # fmt: skip
        assert gone.status_code == 502 and gone.json()["error"]["type"] == "api_error"


# ---------------------------------------------------------------------------- Anthropic


def test_anthropic_fields_reach_the_engine_and_the_answer_has_its_shape(
    router: StubRouter,
) -> None:
    a = _anthropic(router.url)
    m = a.messages.create(
        model=MODEL, max_tokens=2,
        system=[{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [
            {"type": "text", "text": ECHO, "cache_control": {"type": "ephemeral"}}]}],
        stop_sequences=["END"], metadata={"user_id": "u-9"},
        extra_body={"temperature": 0.3, "top_p": 0.8, "top_k": 4},  # not in this SDK's create
    )  # fmt: skip
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == MODEL and m.stop_reason in ("end_turn", "max_tokens")
    block = m.content[0]
    assert block.type == "text"
    sent = _sent(block.text)
    assert sent["messages"] == [{"role": "system", "content": "sys"},
                                {"role": "user", "content": ECHO}]  # fmt: skip
    assert sent["stop"] == ["END"] and sent["user"] == "u-9" and sent["top_k"] == 4
    assert sent["temperature"] == 0.3 and sent["top_p"] == 0.8 and sent["max_tokens"] == 2
    extras: list[dict[str, Any]] = [{"tools": []}, {"thinking": {"type": "disabled"}}]
    for extra in extras:
        assert a.messages.create(model=MODEL, max_tokens=1, messages=[
            {"role": "user", "content": "x"}], extra_body=extra).content  # fmt: skip
    with pytest.raises(anthropic.BadRequestError) as info:
        a.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AA=="}}]}])  # fmt: skip
    assert info.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert info.value.request_id
    with pytest.raises(anthropic.BadRequestError, match=r"metadata\.plan"):
        a.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}],
                          extra_body={"metadata": {"user_id": "u", "plan": "x"}})  # fmt: skip


def test_anthropic_tools_reach_the_engine_as_function_tools(router: StubRouter) -> None:
    a = _anthropic(router.url)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    tool = {"name": "weather", "description": "d", "input_schema": schema}
    m = a.messages.create(  # type: ignore[call-overload]
        model=MODEL, max_tokens=2, tools=[tool], tool_choice={"type": "auto"},
        messages=[{"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                                     "name": "weather", "input": {"city": "x"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                "content": "sunny"},
                                               {"type": "text", "text": ECHO}]}],
    )  # fmt: skip
    block = m.content[0]
    assert block.type == "text"
    sent = _sent(block.text)
    assert sent["tools"][0]["function"]["name"] == "weather" and sent["tool_choice"] == "auto"
    assert [x["role"] for x in sent["messages"]] == ["user", "assistant", "tool", "user"]
    assert sent["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"city":"x"}'
    counted = a.messages.count_tokens(
        model=MODEL,
        tools=[tool],  # type: ignore[list-item]
        messages=[{"role": "user", "content": "weather?"}],
    )
    assert counted.input_tokens > 0


def test_anthropic_stream_events_in_order(router: StubRouter) -> None:
    body = {"model": MODEL, "max_tokens": 2, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    for headers in ({"anthropic-version": "2023-06-01", "x-api-key": "k"}, {}):
        with httpx.stream("POST", router.url + "/v1/messages", json=body, headers=headers,
                          timeout=30) as resp:  # fmt: skip
            assert resp.status_code == 200 and resp.headers["request-id"]
            raw = resp.read().decode()
        events = [e for e in raw.split("\n\n") if e.strip()]
        names = [e.split("\n")[0].removeprefix("event: ") for e in events]
        assert names == ["message_start", "content_block_start", "ping", "content_block_delta",
                         "content_block_delta", "content_block_stop", "message_delta",
                         "message_stop"]  # fmt: skip
        delta = json.loads(events[-2].split("data: ", 1)[1])
        assert (
            delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 2
        )


def test_anthropic_thinking_with_the_sdk(router: StubRouter) -> None:
    """A reasoning model's reasoning as the SDK's ThinkingBlock, whole and streamed (the
    SDK's stream accumulator checks the events' order and indexes); not shown without
    thinking enabled; an earlier answer's thinking sent back is taken."""
    a = _anthropic(router.url)
    ask = [{"role": "user", "content": "__stub_reasoning__"}]
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    m = a.messages.create(model=MODEL, max_tokens=2048, messages=ask,  # type: ignore[arg-type]
                          thinking=thinking)  # fmt: skip
    assert [b.type for b in m.content] == ["thinking", "text"]
    first, text = m.content
    assert first.type == "thinking" and first.thinking == "Let me think. Done."
    assert first.signature and text.type == "text" and text.text == "Answer."
    with a.messages.stream(model=MODEL, max_tokens=2048, messages=ask,  # type: ignore[arg-type]
                           thinking=thinking) as stream:  # fmt: skip
        kinds = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert "thinking" in kinds and "signature" in kinds
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in m.content]
    plain = a.messages.create(model=MODEL, max_tokens=64, messages=ask)  # type: ignore[arg-type]
    assert [b.type for b in plain.content] == ["text"]
    again = [*ask, {"role": "assistant", "content": [first.model_dump(), text.model_dump()]},
             {"role": "user", "content": "__stub_reasoning__ more"}]  # fmt: skip
    assert a.messages.create(model=MODEL, max_tokens=2048, messages=again,  # type: ignore[arg-type]
                             thinking=thinking).content[0].type == "thinking"  # fmt: skip


# ---------------------------------------------------------------------------- errors


def _raw(url: str, method: str, path: str, content: bytes | None = None,
         headers: dict[str, str] | None = None) -> httpx.Response:  # fmt: skip
    return httpx.request(method, url + path, content=content, headers=headers, timeout=30)


def _check_shape(resp: httpx.Response, anthropic_shape: bool, status: int, kind: str) -> None:
    assert resp.status_code == status, resp.text
    doc = resp.json()
    assert resp.headers["x-request-id"]
    if anthropic_shape:
        assert doc["type"] == "error" and doc["error"]["type"] == kind and doc["error"]["message"]
        assert resp.headers["request-id"]
    else:
        assert set(doc["error"]) == {"message", "type", "param", "code"}
        assert doc["error"]["type"] == kind and doc["error"]["message"]


BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}]},
    "/v1/completions": {"prompt": "x"},
    "/v1/messages": {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "x"}]},
}


def test_errors_are_in_the_shape_of_the_api_called(router: StubRouter) -> None:
    json_ct = {"Content-Type": "application/json"}
    version = {"anthropic-version": "2023-06-01"}
    for path, anth in (("/v1/chat/completions", False), ("/v1/completions", False),
                       ("/v1/messages", True), ("/v1/messages/count_tokens", True)):  # fmt: skip
        _check_shape(_raw(router.url, "GET", path), anth, 405, "invalid_request_error")
        _check_shape(_raw(router.url, "POST", path, b"{bad", json_ct), anth, 400,
                     "invalid_request_error")  # fmt: skip
        _check_shape(_raw(router.url, "POST", path, b"", json_ct), anth, 400,
                     "invalid_request_error")  # fmt: skip
        fields = BODIES[path]
        body = json.dumps({"model": MODEL, **fields}).encode()
        xml = {"Content-Type": "application/xml"}
        _check_shape(_raw(router.url, "POST", path, body, xml), anth,
                     415, "invalid_request_error")  # fmt: skip
        nope = json.dumps({"model": "nope", **fields}).encode()
        missing = _raw(router.url, "POST", path, nope, json_ct)
        _check_shape(missing, anth, 404, "not_found_error" if anth else "invalid_request_error")
        if not anth:
            assert missing.json()["error"]["code"] == "model_not_found"
    _check_shape(_raw(router.url, "GET", "/v1/models/nope"), False, 404, "invalid_request_error")
    _check_shape(_raw(router.url, "GET", "/v1/models/nope", headers=version), True, 404,
                 "not_found_error")  # fmt: skip
    _check_shape(_raw(router.url, "POST", "/v1/nothing"), False, 404, "invalid_request_error")
    _check_shape(_raw(router.url, "POST", "/v1/nothing", headers=version), True, 404,
                 "not_found_error")  # fmt: skip
    given = _raw(router.url, "POST", "/v1/completions", b"{", {**json_ct, "x-request-id": "mine"})
    assert given.headers["x-request-id"] == "mine"
    with pytest.raises(openai.NotFoundError) as info:
        _openai(router.url).chat.completions.create(
            model="nope", max_tokens=1, messages=[{"role": "user", "content": "x"}]
        )
    assert info.value.code == "model_not_found" and info.value.request_id
    with pytest.raises(anthropic.NotFoundError):
        _anthropic(router.url).models.retrieve("nope")


def test_keys_in_either_header(kafka_settings: Settings, engines: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-good\n")
    with stub_router(
        kafka_settings, tmp_path, engines, FORETOKEN_ROUTER_API_KEYS_FILE=str(keys)
    ) as r:
        body: Any = {"model": MODEL, "max_tokens": 1,
                     "messages": [{"role": "user", "content": "x"}]}  # fmt: skip
        for headers in ({"x-api-key": "sk-good", "Authorization": "Bearer engine-key"},
                        {"x-api-key": "junk", "Authorization": "Bearer sk-good"},
                        {"Authorization": "bearer sk-good"}):  # fmt: skip
            assert httpx.post(r.url + "/v1/messages", json=body, headers=headers,
                              timeout=30).status_code == 200  # fmt: skip
        assert _anthropic(r.url, "sk-good").messages.create(**body).content
        assert _openai(r.url, "sk-good").models.list().data
        _check_shape(_raw(r.url, "GET", "/v1/models"), False, 401, "authentication_error")
        _check_shape(_raw(r.url, "GET", "/v1/models", headers={"anthropic-version": "2023-06-01"}),
                     True, 401, "authentication_error")  # fmt: skip
        with pytest.raises(anthropic.AuthenticationError):
            _anthropic(r.url, "bad").messages.create(**body)
        with pytest.raises(openai.AuthenticationError):
            _openai(r.url, "bad").chat.completions.create(**body)


def test_chats_are_counted_through_the_model_chat_template(
    kafka_settings: Settings, engines: Path, tmp_path: Path
) -> None:
    """An engines file naming the model's tokenizer.json (a model directory with a chat
    template in tokenizer_config.json): the router counts a chat as the engine renders and
    tokenizes it, and a conversation the template refuses is the engine's 400, in each
    API's shape."""
    model_dir = _model_dir(tmp_path / "model", LLAMA)
    text = tomllib.loads(engines.read_text())
    path = json.dumps(str(model_dir / "tokenizer.json"))
    lines = engines.read_text().replace("[[engines]]\n", f"[[engines]]\ntokenizer = {path}\n")
    assert lines.count("tokenizer =") == len(text["engines"])
    templated = tmp_path / "engines.toml"
    templated.write_text(lines)
    with stub_router(kafka_settings, tmp_path, templated) as r:
        hf = HFTokenizers.from_file(str(model_dir / "tokenizer.json"))
        rendered = ("<s><|start_header_id|>user<|end_header_id|>\n\nhello there<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")  # fmt: skip
        counted = _anthropic(r.url).messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "hello there"}])  # fmt: skip
        ids = hf.encode(rendered, add_special_tokens=False).ids
        assert counted.input_tokens == len(ids) == 10
        hello = [{"role": "user", "content": "hello there"}]
        answer = _openai(r.url).chat.completions.create(model=MODEL, max_tokens=2, messages=hello)
        assert answer.choices[0].message.content
        twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        with pytest.raises(openai.BadRequestError, match="roles must alternate"):
            _openai(r.url).chat.completions.create(model=MODEL, max_tokens=2, messages=twice)
        with pytest.raises(anthropic.BadRequestError, match="roles must alternate"):
            _anthropic(r.url).messages.create(model=MODEL, max_tokens=2, messages=[
                {"role": "assistant", "content": "x"}])  # fmt: skip
    assert "Traceback" not in r.log_text()


def test_a_lora_adapter_goes_to_an_engine_that_serves_it(
    kafka_settings: Settings, engines: Path, tmp_path: Path
) -> None:
    """The engines file names a LoRA adapter on one engine: the adapter is a model of the
    router (listed with its base as parent), its requests all go to that engine (the
    fallback here: no route service) with the adapter's name, and an adapter nobody
    serves is a 404."""
    first, second = load_engines(engines)
    lora = tmp_path / "engines.toml"
    lora.write_text(dump_engines([msgspec.structs.replace(first, max_model_len=8192),
                                  msgspec.structs.replace(second, lora_adapters=("ada",),
                                                          max_model_len=32768)]))  # fmt: skip
    port = second.http_url.rsplit(":", 1)[1]
    with stub_router(kafka_settings, tmp_path, lora) as r:
        listed = {m.id: m for m in _openai(r.url).models.list().data}
        assert listed["ada"].parent == MODEL  # type: ignore[attr-defined]
        assert listed[MODEL].max_model_len == 32768  # type: ignore[attr-defined]  # the longest
        for _ in range(4):  # least-outstanding alone would alternate between the two
            answer = _openai(r.url).completions.create(model="ada", max_tokens=1,
                                                       prompt="__stub_echo_headers__")  # fmt: skip
            assert json.loads(answer.choices[0].text)["host"].endswith(f":{port}")
        sent = _sent(_openai(r.url).completions.create(model="ada", max_tokens=1,
                                                       prompt=ECHO).choices[0].text)  # fmt: skip
        assert sent["model"] == "ada"  # the engine gets the adapter's name
        with pytest.raises(openai.NotFoundError, match="nope"):
            _openai(r.url).completions.create(model="nope", max_tokens=1, prompt="x")
    assert "Traceback" not in r.log_text()
