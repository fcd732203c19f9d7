"""The router as the official openai and anthropic SDKs see it (sync, async, streaming; 429s
and their retries), and the edges of issue 16 that a client meets: bad input is a 4xx naming
the field (never a 500), a stream that breaks ends with an error event and ``[DONE]``, an
engine's own 4xx comes back with its status and message, headers on the allow-list reach the
engine, API keys, body limits and read timeouts, and a 31 MB body that does not stall the
event loop. Real router process, real broker; the engines are the near-zero-cost stub."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from foretoken.settings import Settings
from tests.integration.stub_router import MODEL, StubRouter, stub_engines, stub_router

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with stub_engines(tmp_path_factory.mktemp("stub")) as path:
        yield path


@pytest.fixture(scope="module")
def router(
    kafka_settings: Settings, tmp_path_factory: pytest.TempPathFactory, engines: Path
) -> Iterator[StubRouter]:
    with stub_router(
        kafka_settings,
        tmp_path_factory.mktemp("router"),
        engines,
        FORETOKEN__ROUTER__BODY_READ_TIMEOUT_S="2",
    ) as r:
        yield r
    assert "Traceback" not in r.log_text()


def _openai(r: StubRouter, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=r.url + "/v1", api_key="k", max_retries=retries)


def _anthropic(r: StubRouter, retries: int = 0) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=r.url, api_key="k", max_retries=retries)


def post(
    r: StubRouter, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(
        r.url + path,
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


# ---------------------------------------------------------------------------- SDKs


def test_openai_sdk_sync_async_and_streaming(router: StubRouter) -> None:
    c = _openai(router)
    text = c.completions.create(model=MODEL, prompt="hello there", max_tokens=3)
    assert text.choices[0].text == " tok tok tok" and text.usage is not None
    ids = c.completions.create(model=MODEL, prompt=[16, 17, 18, 19], max_tokens=2)
    assert ids.choices[0].text == " tok tok"
    chat = c.chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == " tok tok"
    stream = c.chat.completions.create(
        model=MODEL,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hi"}],
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == " tok" * 3
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    assert c.models.retrieve(MODEL).id == MODEL
    assert [m.id for m in c.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("nope")
    raw = c.completions.with_raw_response.create(
        model=MODEL, prompt="x", max_tokens=1, extra_headers={"x-request-id": "cli-1"}
    )
    assert raw.headers["x-request-id"] == "cli-1"

    async def run_async() -> None:
        ac = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
        reply = await ac.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert reply.choices[0].text == " tok tok"
        pieces = [
            ch.choices[0].text
            async for ch in await ac.completions.create(
                model=MODEL, prompt="hi", max_tokens=2, stream=True
            )
            if ch.choices
        ]
        assert "".join(pieces) == " tok tok"
        await ac.close()

    asyncio.run(run_async())


def test_anthropic_sdk_messages_streaming_and_count_tokens(router: StubRouter) -> None:
    c = _anthropic(router)
    m = c.messages.create(
        model=MODEL,
        max_tokens=3,
        system="be brief",
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
    )
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens"
    assert m.content[0].type == "text" and m.content[0].text == " tok tok tok"
    assert m.usage.output_tokens == 3 and m.usage.input_tokens > 0
    with c.messages.stream(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        assert "".join(stream.text_stream) == " tok tok"
        final = stream.get_final_message()
    assert final.usage.output_tokens == 2 and final.stop_reason == "max_tokens"
    events = [
        e.type
        for e in c.messages.create(
            model=MODEL, max_tokens=1, stream=True, messages=[{"role": "user", "content": "x"}]
        )
    ]
    assert events == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]  # the SDK skips pings
    counted = c.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert counted.input_tokens > 0
    # function tools are taken (translated to the engine's); a server tool runs at Anthropic
    assert c.messages.create(
        model=MODEL,
        max_tokens=1,
        messages=[{"role": "user", "content": "x"}],
        tools=[{"name": "t", "input_schema": {"type": "object"}}],
    ).content
    with pytest.raises(anthropic.BadRequestError, match="server tools"):
        c.messages.create(
            model=MODEL,
            max_tokens=1,
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "web_search_20250305", "name": "web_search"}],
        )
    with pytest.raises(anthropic.NotFoundError) as info:
        c.messages.create(model="nope", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]

    async def run_async() -> None:
        ac = anthropic.AsyncAnthropic(base_url=router.url, api_key="k", max_retries=0)
        reply = await ac.messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.content[0].text == " tok tok"  # type: ignore[union-attr]
        async with ac.messages.stream(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        ) as s:
            assert "".join([t async for t in s.text_stream]) == " tok tok"
        await ac.close()

    asyncio.run(run_async())


def test_429s_tell_the_sdks_when_to_retry(
    kafka_settings: Settings, engines: Path, tmp_path: Path
) -> None:
    """Every worker past the fallback's overload: a 429 whose Retry-After the SDKs honour
    (one retry, after the advised 1 s), in each SDK's error shape."""
    with stub_router(
        kafka_settings,
        tmp_path,
        engines,
        FORETOKEN__ROUTER__FALLBACK_OVERLOAD_TOKENS="0",
        FORETOKEN__ROUTER__FALLBACK_RETRY_AFTER_S="1",
    ) as r:
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as info:
            _openai(r, retries=1).completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert time.monotonic() - started >= 1.0  # waited once, as told
        resp = info.value.response
        assert resp.headers["retry-after-ms"] == "1000" and resp.headers["retry-after"] == "1"
        assert "x-should-retry" not in resp.headers
        assert "overloaded" in resp.json()["error"]["message"]
        with pytest.raises(anthropic.RateLimitError) as ainfo:
            _anthropic(r).messages.create(
                model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}]
            )
        body = ainfo.value.body
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
        assert ainfo.value.response.headers["retry-after"] == "1"
        metrics = urllib.request.urlopen(r.url + "/metrics", timeout=5).read().decode()
        assert 'foretoken_router_requests_total{outcome="rejected"} 3.0' in metrics
        with pytest.raises(openai.RateLimitError) as info:  # a batch: turned away as one
            _openai(r).completions.create(model=MODEL, prompt=["x", "y"], max_tokens=1)
        assert info.value.response.headers["retry-after"] == "1"


# ---------------------------------------------------------------------------- bad input

BAD = [
    (b'{"model":"stub-model","prompt":"x","stream":"false"}', "stream"),
    (b'{"model":["a"],"prompt":"x"}', "model"),
    (b'{"model":{"a":1},"prompt":"x"}', "model"),
    (b'{"model":"stub-model","prompt":[true,false]}', "prompt[0]"),
    (b'{"model":"stub-model","prompt":"x","max_tokens":1e30}', "max_tokens"),
    (b'{"model":"stub-model","prompt":"x","max_tokens":1e400}', "max_tokens"),
    (b'{"model":"stub-model","prompt":"x","max_tokens":100000000000000000000}', "max_tokens"),
    (b'{"model":"stub-model","prompt":"   "}', "prompt"),
    (b'{"model":"stub-model","prompt":"x","prefer_cache_hit":"no"}', "prefer_cache_hit"),
    (b'{"model":"stub-model","prompt":[-1]}', "prompt[0]"),
    (b'{"model":"stub-model","prompt":[4294967296]}', "prompt[0]"),
    (b'{"model":"stub-model","prompt":["a",""]}', "prompt[1]"),
    (b'{"model":"stub-model","prompt":[1,[2]]}', "prompt[0]"),
    (b'{"model":"stub-model","prompt":"x","stream":true,"stream_options":5}', "stream_options"),
    (
        b'{"model":"stub-model","prompt":"x","stream_options":{"include_usage":true}}',
        "stream_options",
    ),
    (b'{"model":"stub-model","prompt":"x","best_of":4}', "best_of"),
    (b'{"model":"stub-model","prompt":"x","max_queue_wait_s":1e999}', "max_queue_wait_s"),
    (b'{"model":"stub-model","prompt":"x","already_waited_s":-5}', "already_waited_s"),
    (b'{"model":"a\xff","prompt":"x"}', None),
    (b'{"model":"stub-model","prompt":"\\ud800"}', None),
    (b'{"model":"stub-model","x":' + b"[" * 100_000 + b"]" * 100_000 + b',"prompt":"x"}', None),
    (b'{"model":"stub-model","prompt":"x"} trailing', None),
    (b"[1,2,3]", None),
]
BAD_CHAT = [
    (b'{"model":"stub-model","messages":"hi"}', "messages"),
    (b'{"model":"stub-model","messages":5}', "messages"),
    (b'{"model":"stub-model","messages":null}', "messages"),
    (b'{"model":"stub-model","messages":[]}', "messages"),
    (b'{"model":"stub-model","messages":[{"content":"x"}]}', "messages[0].role"),
    (b'{"model":"stub-model","messages":[{"role":"user","content":5}]}', "messages[0].content"),
]
BAD_ANTHROPIC = [
    (b'{"model":"stub-model","messages":[{"role":"user","content":"x"}]}', "max_tokens"),
    (
        b'{"model":"stub-model","max_tokens":1,"messages":[{"role":"robot","content":"x"}]}',
        "messages[0].role",
    ),
    (
        b'{"model":"stub-model","max_tokens":1,"messages":[{"role":"user","content":[{"type":'
        b'"image","source":{}}]}]}',
        "messages[0].content[0].type",
    ),
    (b'{"model":"stub-model","max_tokens":1,"frobnicate":1,"messages":[]}', "frobnicate"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_completions_are_4xx_naming_the_field(
    router: StubRouter, body: bytes, param: str | None
) -> None:
    status, _, raw = post(router, "/v1/completions", body)
    assert 400 <= status < 500, raw
    error = json.loads(raw)["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param and param.split("[")[0] in error["message"]


@pytest.mark.parametrize(("body", "param"), BAD_CHAT)
def test_bad_chat_is_4xx_naming_the_field(router: StubRouter, body: bytes, param: str) -> None:
    status, _, raw = post(router, "/v1/chat/completions", body)
    assert status == 400, raw
    assert json.loads(raw)["error"]["param"] == param


@pytest.mark.parametrize(("body", "param"), BAD_ANTHROPIC)
def test_bad_messages_are_4xx_in_anthropic_shape(
    router: StubRouter, body: bytes, param: str
) -> None:
    status, _, raw = post(router, "/v1/messages", body)
    assert status == 400, raw
    doc = json.loads(raw)
    assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error"
    assert param.split("[")[0] in doc["error"]["message"]


def test_unknown_fields_pass_through_and_n_choices_come_back(router: StubRouter) -> None:
    """Fields the router does not handle reach the engine as the client's bytes (the stub's
    choice 0 says the body it got), foretoken's own do not, and ``n`` choices come back."""
    body = (b'{"model":"stub-model","prompt":"__stub_echo_body__","n":2,"logprobs":2,'
            b'"echo":true,"temperature":0.70,"suffix":"!","max_tokens":1,'
            b'"max_queue_wait_s":30}')  # fmt: skip
    status, _, raw = post(router, "/v1/completions", body)
    assert status == 200, raw
    doc = json.loads(raw)
    assert [c["index"] for c in doc["choices"]] == [0, 1]
    assert doc["choices"][1]["text"] == " tok"
    sent = doc["choices"][0]["text"].encode()
    for field in (b'"n":2', b'"logprobs":2', b'"echo":true', b'"temperature":0.70',
                  b'"suffix":"!"'):  # fmt: skip
        assert field in sent, (field, sent)
    assert b"max_queue_wait_s" not in sent


def test_chat_tools_logprobs_and_n_reach_the_engine(router: StubRouter) -> None:
    tools: list[Any] = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    c = _openai(router)
    stream = c.chat.completions.create(
        model=MODEL,
        max_tokens=1,
        n=2,
        stream=True,
        logprobs=True,
        top_logprobs=3,
        tools=tools,
        tool_choice="auto",
        messages=[{"role": "user", "content": "__stub_echo_body__"}],
    )
    chunks = [ch for ch in stream if ch.choices]
    assert {ch.choices[0].index for ch in chunks} == {0, 1}
    first = next(ch.choices[0] for ch in chunks if ch.choices[0].index == 0)
    assert first.delta.role == "assistant"
    sent = json.loads(first.delta.content or "{}")
    assert sent["tools"] == tools and sent["tool_choice"] == "auto"
    assert sent["logprobs"] is True and sent["top_logprobs"] == 3 and sent["n"] == 2
    whole = c.chat.completions.create(
        model=MODEL, max_tokens=1, n=2, messages=[{"role": "user", "content": "__stub_echo_body__"}]
    )
    assert [ch.index for ch in whole.choices] == [0, 1]
    assert whole.choices[1].message.content == " tok"


# ---------------------------------------------------------------------------- streams


def test_a_stream_that_breaks_ends_with_an_error_event_and_done(router: StubRouter) -> None:
    for marker, words in (
        ("__stub_break__", "stream broke"),
        ("__stub_error_event__", "stub failed mid-stream"),
    ):
        body = json.dumps({"model": MODEL, "prompt": marker, "max_tokens": 3, "stream": True})
        status, _, raw = post(router, "/v1/completions", body.encode())
        assert status == 200
        events = [e for e in raw.decode().split("\n\n") if e.startswith("data:")]
        assert events[-1] == "data: [DONE]" and "error" in events[-2], events
        assert words in events[-2]
        stream = _openai(router).completions.create(
            model=MODEL, prompt=marker, max_tokens=3, stream=True
        )
        with pytest.raises(openai.APIError, match=words):
            list(stream)
        message = [{"role": "user", "content": marker}]
        with (
            pytest.raises(anthropic.APIStatusError, match=words),
            _anthropic(router).messages.stream(model=MODEL, max_tokens=3, messages=message) as s,  # type: ignore[arg-type]
        ):
            list(s.text_stream)
        # not streamed: a 502 with the engine's words
        status, _, raw = post(
            router,
            "/v1/completions",
            json.dumps({"model": MODEL, "prompt": marker, "max_tokens": 3}).encode(),
        )
        assert status == 502 and words in json.loads(raw)["error"]["message"]


def test_an_engine_4xx_comes_back_with_its_status_and_message(router: StubRouter) -> None:
    with pytest.raises(openai.BadRequestError, match="stub refuses: prompt too long"):
        _openai(router).completions.create(model=MODEL, prompt="__stub_refuse__", max_tokens=1)
    stream = _openai(router).chat.completions.create
    with pytest.raises(openai.BadRequestError, match="stub refuses"):
        stream(
            model=MODEL,
            max_tokens=1,
            stream=True,
            messages=[{"role": "user", "content": "__stub_refuse__"}],
        )
    with pytest.raises(anthropic.BadRequestError, match="stub refuses"):
        _anthropic(router).messages.create(
            model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "__stub_refuse__"}]
        )


# ---------------------------------------------------------------------------- headers, keys


def _echoed(r: StubRouter, headers: dict[str, str]) -> dict[str, str]:
    body = json.dumps({"model": MODEL, "prompt": "__stub_echo_headers__", "max_tokens": 1})
    status, _, raw = post(r, "/v1/completions", body.encode(), headers)
    assert status == 200, raw
    return dict(json.loads(json.loads(raw)["choices"][0]["text"]))


def test_allow_listed_headers_reach_the_engine(router: StubRouter) -> None:
    got = _echoed(
        router,
        {
            "Authorization": "Bearer engine-key",
            "traceparent": "00-ab-cd-01",
            "x-request-id": "hdr-1",
            "Cookie": "s=1",
            "x-api-key": "ak",
        },
    )
    assert got["authorization"] == "Bearer engine-key" and got["traceparent"] == "00-ab-cd-01"
    assert got["x-request-id"] == "hdr-1"
    assert "cookie" not in got and "x-api-key" not in got  # not on the default list


def test_api_keys_and_configured_forwarding(
    kafka_settings: Settings, engines: Path, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-one\nsk-two\n")
    config = tmp_path / "router.toml"
    config.write_text(
        '[router]\nforward_headers = ["authorization", "x-api-key", "openai-organization"]\n'
    )
    with stub_router(
        kafka_settings,
        tmp_path,
        engines,
        FORETOKEN_CONFIG=str(config),
        FORETOKEN_ROUTER_API_KEYS_FILE=str(keys),
    ) as r:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=r.url + "/v1", api_key="wrong", max_retries=0).models.list()
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=r.url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}]
            )
        ok = openai.OpenAI(base_url=r.url + "/v1", api_key="sk-two", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt="x", max_tokens=1).choices
        reply = anthropic.Anthropic(base_url=r.url, api_key="sk-one", max_retries=0)
        assert reply.messages.create(
            model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}]
        ).content
        got = _echoed(r, {"x-api-key": "sk-one", "OpenAI-Organization": "org-1"})
        assert got["x-api-key"] == "sk-one" and got["openai-organization"] == "org-1"
        assert "traceparent" not in got


# ---------------------------------------------------------------------------- big bodies


def _raw_request(r: StubRouter, head: bytes, body: bytes, wait_s: float) -> bytes:
    """Send a request head and part of a body; the answer's first bytes (or b"")."""
    host, port = r.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        sock.sendall(head + body)
        try:
            return sock.recv(65536)
        except TimeoutError:
            return b""


def test_a_body_that_never_arrives_hits_the_read_timeout(router: StubRouter) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1048576\r\n\r\n"
    )
    started = time.monotonic()
    answer = _raw_request(router, head, b"x" * 1024, wait_s=10.0)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"body_read_timeout_s" in answer and time.monotonic() - started < 6.0
    declared = head.replace(b"1048576", b"104857600")  # 100 MB: over the limit at once
    answer = _raw_request(router, declared, b"x" * 1024, wait_s=10.0)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_a_31_mb_body_does_not_stall_the_event_loop(router: StubRouter) -> None:
    """A 31 MB text prompt (7M built-in tokens, over router.max_prompt_tokens) gets a 400
    while /healthz keeps answering: decoding and tokenizing run off the event loop."""
    body = json.dumps({"model": MODEL, "prompt": "w123 tok, " * 3_100_000}).encode()
    assert len(body) > 31_000_000
    result: dict[str, tuple[int, dict[str, str], bytes]] = {}

    def big() -> None:
        result["answer"] = post(router, "/v1/completions", body)

    thread = threading.Thread(target=big)
    thread.start()
    worst = 0.0
    with httpx.Client(timeout=10) as client:
        while thread.is_alive():
            started = time.monotonic()
            assert client.get(router.url + "/healthz").status_code == 200
            worst = max(worst, time.monotonic() - started)
            time.sleep(0.02)
    thread.join()
    status, _, raw = result["answer"]
    assert status == 400 and b"max_prompt_tokens" in raw
    assert worst < 1.0, f"/healthz took {worst:.2f} s while the big body was handled"
    print(f"worst /healthz latency during a 31 MB body: {worst * 1000:.0f} ms")
