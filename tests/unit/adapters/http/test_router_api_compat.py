"""The router's compatibility with what the official openai and anthropic SDKs and the
benchmark tools send, without a server: nulls where OpenAI's API takes them, stream options
kept, a batch of one (lm-eval's ``[[ids]]``) sent as its prompt and a batch of several
as one engine body per prompt, text parts without text
refused, Anthropic fields that are not handled refused (never dropped) and the ones that ask
for nothing taken; the role on every choice's first streamed delta, the usage's cached
tokens, an assembled answer that keeps what the engine said, an engine's refusal in the
caller's shape, and the body's media type."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import make_mocked_request

from foretoken.adapters.http.router.anthropic import decode_count_tokens, decode_messages
from foretoken.adapters.http.router.edge import engine_refusal, read_body
from foretoken.adapters.http.router.errors import anthropic_kind, anthropic_shape
from foretoken.adapters.http.router.proxy import Collected, Measured, OpenAIStream, read_chunk
from foretoken.adapters.http.router.requests import RequestError, decode_openai
from foretoken.settings import load_settings

LIMIT = 1000
USER = [{"role": "user", "content": "hi"}]


def _chat(**fields: Any) -> bytes:
    return msgspec.json.encode({"model": "m", "messages": USER, **fields})


# ---------------------------------------------------------------------------- OpenAI bodies


@pytest.mark.parametrize("name", ["n", "stream", "echo", "use_beam_search", "stream_options"])
def test_null_is_the_default_where_openai_takes_it(name: str) -> None:
    raw = msgspec.json.encode({"model": "m", "prompt": "hi", name: None})
    d = decode_openai(raw, chat=False, max_output_tokens=LIMIT)
    assert not d.wants_usage and json.loads(d.upstream)["stream"] is True
    if name == "n":
        assert d.body.n is None and name in json.loads(d.upstream)  # passed on as sent


def test_a_cache_salt_is_read_and_reaches_the_engine() -> None:
    d = decode_openai(_chat(cache_salt="tenant-a"), chat=True, max_output_tokens=LIMIT)
    assert d.body.cache_salt == "tenant-a" and json.loads(d.upstream)["cache_salt"] == "tenant-a"
    with pytest.raises(RequestError, match="cache_salt"):
        decode_openai(_chat(cache_salt="x" * 257), chat=True, max_output_tokens=LIMIT)


def test_stream_options_keys_reach_the_engine_and_usage_only_when_asked() -> None:
    options = {"include_usage": False, "include_obfuscation": False, "continuous_usage_stats": True}
    d = decode_openai(
        _chat(stream=True, stream_options=options), chat=True, max_output_tokens=LIMIT
    )
    sent = json.loads(d.upstream)["stream_options"]
    assert sent == {**options, "include_usage": True} and not d.wants_usage
    d = decode_openai(_chat(stream=True, stream_options={"include_usage": True}), chat=True,
                      max_output_tokens=LIMIT)  # fmt: skip
    assert d.wants_usage
    d = decode_openai(_chat(stream=True), chat=True, max_output_tokens=LIMIT)
    assert not d.wants_usage and json.loads(d.upstream)["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("prompt", "sent"), [([[5, 6, 7]], [5, 6, 7]), (["hello"], "hello"), ([5, 6], [5, 6])]
)
def test_a_batch_of_one_reaches_the_engine_as_its_prompt(prompt: Any, sent: Any) -> None:
    raw = msgspec.json.encode({"model": "m", "prompt": prompt, "max_tokens": 1, "echo": True,
                               "logprobs": 1})  # fmt: skip
    up = json.loads(decode_openai(raw, chat=False, max_output_tokens=LIMIT).upstream)
    assert up["prompt"] == sent and up["echo"] is True and up["logprobs"] == 1


def test_a_batch_of_several_prompts_is_one_engine_body_per_prompt() -> None:
    raw = msgspec.json.encode({"model": "m", "prompt": ["hi", [5, 6], "yo"], "max_tokens": 2,
                               "n": 2, "logprobs": 1, "foo": {"bar": 1}})  # fmt: skip
    d = decode_openai(raw, chat=False, max_output_tokens=LIMIT, max_batch=3)
    assert [(t, None if i is None else i.tolist()) for t, i, _ in d.batch] == [
        ("hi", None), (None, [5, 6]), ("yo", None)]  # fmt: skip
    for i, prompt in enumerate(["hi", [5, 6], "yo"]):
        up = json.loads(d.batch_body(i))  # the client's fields, with this one prompt, streaming
        assert up["prompt"] == prompt and up["stream"] is True and up["n"] == 2
        assert up["logprobs"] == 1 and up["foo"] == {"bar": 1} and up["max_tokens"] == 2


@pytest.mark.parametrize(
    ("prompt", "param"),
    [(["a", ""], "prompt[1]"), ([1, [2]], "prompt[0]"), ([[1], []], "prompt[1]"), ([], "prompt")],
)
def test_a_bad_prompt_of_a_batch_is_named(prompt: Any, param: str) -> None:
    with pytest.raises(RequestError) as info:
        decode_openai(msgspec.json.encode({"model": "m", "prompt": prompt}), chat=False,
                      max_output_tokens=LIMIT, max_batch=8)  # fmt: skip
    assert info.value.param == param, info.value.message


def test_a_batch_over_the_limit_is_refused_before_its_bodies_are_built() -> None:
    raw = msgspec.json.encode({"model": "m", "prompt": ["a"] * 2000, "junk": "x" * 200_000})
    with pytest.raises(RequestError, match="max_batch_prompts"):
        decode_openai(raw, chat=False, max_output_tokens=LIMIT, max_batch=256)
    d = decode_openai(raw, chat=False, max_output_tokens=LIMIT, max_batch=2000)
    assert len(d.upstream) < 200_100  # the shared fields once, not once per prompt


def test_chat_fields_reach_the_engine_untouched() -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "name": "bob", "content": [{"type": "text", "text": "hi"},
                                                    {"type": "image_url",
                                                     "image_url": {"url": "data:x"}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]  # fmt: skip
    fields = {
        "messages": messages, "max_completion_tokens": 7, "seed": 3, "stop": ["a", "b"],
        "user": "u", "metadata": {"k": "v"}, "parallel_tool_calls": False, "logprobs": True,
        "top_logprobs": 2, "response_format": {"type": "json_object"}, "n": 2,
        "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
    }  # fmt: skip
    d = decode_openai(_chat(**fields), chat=True, max_output_tokens=LIMIT)
    up = json.loads(d.upstream)
    assert {k: up[k] for k in fields} == fields and d.max_output_tokens == 7
    assert d.text is not None and "<|developer|> be brief" in d.text and "hi" in d.text


def test_bad_bytes_in_stream_options_are_a_400() -> None:
    raw = (b'{"model":"m","prompt":"x","stream":true,'
           b'"stream_options":{"in\xac\xe6clude_usage":true}}')  # fmt: skip
    with pytest.raises(RequestError) as info:
        decode_openai(raw, chat=False, max_output_tokens=LIMIT)
    assert info.value.status == 400


def test_a_text_part_without_text_is_named() -> None:
    raw = _chat(messages=[{"role": "user", "content": [{"type": "text"}]}])
    with pytest.raises(RequestError) as info:
        decode_openai(raw, chat=True, max_output_tokens=LIMIT)
    assert info.value.param == "messages[0].content[0].text"


# ---------------------------------------------------------------------------- Anthropic


def _messages(**fields: Any) -> bytes:
    return msgspec.json.encode({"model": "m", "max_tokens": 5, "messages": USER, **fields})


def test_anthropic_cache_control_and_sampling_are_taken() -> None:
    system = [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}]
    content = [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "5m"}}]
    body, _, upstream, _ = decode_messages(_messages(
        system=system, messages=[{"role": "user", "content": content}], stop_sequences=["x"],
        metadata={"user_id": "u1"}, temperature=0.5, top_p=0.9, top_k=5, stream=None,
    ))  # fmt: skip
    up = json.loads(upstream)
    assert up["messages"] == [{"role": "system", "content": "sys"},
                              {"role": "user", "content": "hi"}]  # fmt: skip
    assert up["stop"] == ["x"] and up["user"] == "u1" and up["top_k"] == 5
    assert up["temperature"] == 0.5 and up["top_p"] == 0.9 and not body.stream


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": []},
        {"tool_choice": {"type": "none"}},
        {"thinking": {"type": "disabled"}},
        {"mcp_servers": []},
    ],
)
def test_anthropic_options_that_ask_for_nothing_are_taken(fields: dict[str, Any]) -> None:
    decode_messages(_messages(**fields))
    decode_count_tokens(msgspec.json.encode({"model": "m", "messages": USER, **fields}))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"metadata": {"user_id": "u", "tier": 1}}, "metadata.tier"),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "foo": 1}]}]},
         "messages[0].content[0].foo"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                     "source": {}}]}]},
         "messages[0].content[0].source"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_result",
                                                          "tool_use_id": "t", "content": "x"}]}]},
         "messages[0].content[0].type"),  # a tool result is the user's
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t",
                                                     "name": "f", "input": {}}]}]},
         "messages[0].content[0].type"),  # a tool call is the assistant's
        ({"system": [{"type": "text", "text": "s", "citations": [{}]}]}, "system[0].citations"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"name": "t"}]}, "tools[0].input_schema"),
        ({"tool_choice": {"type": "auto"}}, "tool_choice"),  # without tools
        ({"tool_choice": {"type": "tool"}, "tools": [{"name": "t", "input_schema": {}}]},
         "tool_choice.name"),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ],
)  # fmt: skip
def test_anthropic_fields_not_handled_are_refused(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as info:
        decode_messages(_messages(**fields))
    assert info.value.status == 400 and param in info.value.message


# ---------------------------------------------------------------------------- relays


class _Sink:
    def __init__(self) -> None:
        self.data = b""

    async def write(self, data: bytes) -> None:
        self.data += data


def _events(sink: _Sink) -> list[dict[str, Any]]:
    out = []
    for event in sink.data.decode().split("\n\n"):
        if event.startswith("data: ") and event != "data: [DONE]":
            out.append(json.loads(event[6:]))
    return out


def _chunk(index: int, delta: dict[str, Any]) -> bytes:
    return msgspec.json.encode({"object": "chat.completion.chunk",
                                "choices": [{"index": index, "delta": delta}]})  # fmt: skip


async def test_every_choice_s_first_delta_has_the_role() -> None:
    sink = _Sink()
    stream = OpenAIStream(None, sink, chat=True, wants_usage=False, n=2)  # type: ignore[arg-type]
    payloads = [_chunk(0, {"content": "a"}), _chunk(0, {"content": "b"}),
                _chunk(1, {"content": "c"}), _chunk(1, {"content": "d"})]  # fmt: skip
    await stream.send([(p, None) for p in payloads])
    roles = [
        (e["choices"][0]["index"], e["choices"][0]["delta"].get("role")) for e in _events(sink)
    ]
    assert roles == [(0, "assistant"), (0, None), (1, "assistant"), (1, None)]
    assert not stream.role_pending


async def test_usage_says_zero_cached_tokens_for_an_engine_that_reports_them() -> None:
    usage = b'{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1}}'
    for reports, expected in ((True, {"cached_tokens": 0}), (False, None)):
        sink = _Sink()
        stream = OpenAIStream(None, sink, chat=True, wants_usage=True,  # type: ignore[arg-type]
                              reports_cached=reports)  # fmt: skip
        await stream.send([(usage, read_chunk(usage))])
        assert _events(sink)[0]["usage"].get("prompt_tokens_details") == expected
        collected = Collected(chat=True, reports_cached=reports)
        await collected.send([(usage, None)])
        answer = collected.answer("m", "r")
        assert answer["usage"].get("prompt_tokens_details") == expected


async def test_usage_on_every_chunk_only_when_the_client_asked_for_usage() -> None:
    """``continuous_usage_stats`` without ``include_usage``: the engine puts usage on every
    chunk because the router asks for usage (for its measurement); vLLM gives it only with
    include_usage, so neither does the router. Before, every chunk had it."""
    from foretoken.adapters.http.router.batch import _BatchStream, _Part

    usage = {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}
    content = msgspec.json.encode(
        {
            "object": "chat.completion.chunk",
            "usage": usage,
            "choices": [{"index": 0, "delta": {"content": "a"}}],
        }
    )
    final = msgspec.json.encode({"choices": [], "usage": usage})
    for wants in (False, True):
        sink = _Sink()
        stream = OpenAIStream(None, sink, chat=True, wants_usage=wants)  # type: ignore[arg-type]
        await stream.send([(p, read_chunk(p)) for p in (content, final)])
        events = _events(sink)
        assert events[0]["choices"][0]["delta"] == {"content": "a", "role": "assistant"}
        assert [e.get("usage") for e in events] == ([usage, usage] if wants else [None])
        batch = _BatchStream(None, _Sink(), wants, False)  # type: ignore[arg-type]
        await _Part(batch, 0).send([(content, None)])
        assert ("usage" in _events(batch.response)[0]) is wants  # type: ignore[arg-type]


async def test_the_assembled_answer_keeps_what_the_engine_said() -> None:
    collected = Collected(chat=True)
    events = [
        b'{"id":"chatcmpl-1","created":5,"model":"m","service_tier":"default","choices":'
        b'[{"index":0,"delta":{"role":"assistant","reasoning_content":"thinking "}}]}',
        b'{"id":"chatcmpl-1","choices":[{"index":0,"delta":{"reasoning_content":"more",'
        b'"content":"hi"}}]}',
        b'{"id":"chatcmpl-1","choices":[{"index":0,"delta":{},"finish_reason":"stop",'
        b'"matched_stop":7}]}',
    ]
    await collected.send([(e, None) for e in events])
    answer = collected.answer("m", "r")
    assert answer["id"] == "chatcmpl-1" and answer["service_tier"] == "default"
    choice = answer["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "hi",
                                 "reasoning_content": "thinking more"}  # fmt: skip
    assert choice["matched_stop"] == 7 and choice["finish_reason"] == "stop"
    assert Collected(chat=True).answer("m", "r")["id"] == "chatcmpl-r"


# ---------------------------------------------------------------------------- edges


@pytest.mark.parametrize(
    ("body", "kind", "code"),
    [
        (b'{"error":"TGI says no"}', "invalid_request_error", None),
        (b'{"object":"error","message":"vllm says no","type":"BadRequestError","code":400}',
         "BadRequestError", 400),
        (b'{"error":{"message":"it says no","type":"BadRequestError","param":"n","code":"x"}}',
         "BadRequestError", "x"),
        (b"not json", "invalid_request_error", None),
    ],
)  # fmt: skip
def test_an_engine_refusal_is_in_the_callers_shape(body: bytes, kind: str, code: Any) -> None:
    from foretoken.adapters.http.router.proxy import engine_error_message

    m = Measured(status="error", engine_status=400, engine_body=body,
                 error=engine_error_message(400, body))  # fmt: skip
    doc = json.loads(engine_refusal(m, False, "rid").body)  # type: ignore[arg-type]
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert doc["error"]["type"] == kind and doc["error"]["code"] == code
    assert doc["error"]["message"] == m.error and doc["error"]["param"] in (None, "n")
    anthropic = engine_refusal(m, True, "rid")
    adoc = json.loads(anthropic.body)  # type: ignore[arg-type]
    assert adoc["type"] == "error" and adoc["error"]["type"] == "invalid_request_error"
    assert anthropic.headers["request-id"] == "rid"
    m.engine_status, m.engine_retry_after = 500, "7"
    assert engine_refusal(m, False, "rid").status == 502
    assert "retry-after" not in engine_refusal(m, False, "rid").headers
    m.engine_status = 503  # overloaded: kept, with the engine's Retry-After, as 429 is
    assert engine_refusal(m, False, "rid").status == 503
    assert engine_refusal(m, True, "rid").headers["retry-after"] == "7"


def test_anthropic_input_tokens_are_the_uncached_ones() -> None:
    """Anthropic's usage: input + cache_read (+ cache_creation) is the prompt. Before, the
    cached tokens were counted in both."""
    from foretoken.adapters.http.router.anthropic import AnthropicRelay

    relay = AnthropicRelay(make_mocked_request("POST", "/v1/messages"), None, "msg_1", "m", 100)
    hit = Measured(prompt_tokens=100, cached_tokens=64, usage_seen=True, output_tokens=3)
    assert relay.usage(hit) == {"input_tokens": 36, "output_tokens": 3,
                                "cache_read_input_tokens": 64}  # fmt: skip
    relay.reports_cached = True
    miss = Measured(prompt_tokens=100, usage_seen=True, output_tokens=3)  # vLLM omits it
    assert relay.usage(miss) == {"input_tokens": 100, "output_tokens": 3,
                                 "cache_read_input_tokens": 0}  # fmt: skip


def test_anthropic_error_types_and_which_shape() -> None:
    assert [anthropic_kind(s) for s in (400, 404, 405, 415, 429, 500, 502, 504, 529)] == [
        "invalid_request_error", "not_found_error", "invalid_request_error",
        "invalid_request_error", "rate_limit_error", "api_error", "api_error", "timeout_error",
        "overloaded_error",
    ]  # fmt: skip
    version = {"anthropic-version": "2023-06-01"}
    assert anthropic_shape(make_mocked_request("POST", "/v1/messages/count_tokens"))
    assert not anthropic_shape(make_mocked_request("GET", "/v1/models"))
    assert anthropic_shape(make_mocked_request("GET", "/v1/models/x", headers=version))
    assert not anthropic_shape(make_mocked_request("POST", "/v1/chat/completions",
                                                   headers=version))  # fmt: skip


@pytest.mark.parametrize(
    ("content_type", "ok"),
    [
        (None, True),
        ("application/json", True),
        ("application/json; charset=utf-8", True),
        ("Application/JSON", True),
        ("application/vnd.api+json", True),
        ("application/octet-stream", True),
        ("application/msgpack", False),
        ("text/plain", True),  # curl -d and simple clients: read as JSON
        ("application/x-www-form-urlencoded", True),
        ("application/xml", False),
        ("multipart/form-data; boundary=x", False),
    ],
)
async def test_the_body_must_be_json_by_its_media_type(content_type: str | None, ok: bool) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    request = make_mocked_request("POST", "/v1/completions", headers=headers)
    if ok:
        await read_body(request, load_settings(env={}))
        return
    with pytest.raises(RequestError) as info:
        await read_body(request, load_settings(env={}))
    assert info.value.status == 415 and "application/json" in info.value.message


def test_only_events_with_output_count_as_tokens() -> None:
    """A streamed answer without usage counts its content events; finishes, role-only deltas
    and empty texts are not tokens, whichever choice (n > 1) they belong to."""
    from foretoken.adapters.http.router.proxy import _scan

    def event(body: str) -> bytes:
        return b"data: " + body.encode() + b"\n\n"

    chat = [
        '{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}',
        '{"choices":[{"index":1,"delta":{"role":"assistant","content":""}}]}',
        '{"choices":[{"index":0,"delta":{"content":"a"}}]}',
        '{"choices":[{"index":1,"delta":{"content":"b"}}]}',
        '{"choices":[{"index":0,"delta":{"content":"c"}}]}',
        '{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}',
        '{"choices":[{"index":1,"delta": {},"finish_reason":"length"}]}',
        '{"choices":[{"index":0,"text":"","finish_reason":"stop"}]}',
    ]
    m, firsts = Measured(), list[float]()
    _scan([event(b) for b in chat] + [b"data: [DONE]\n\n"], m, firsts.append)
    assert m.chunks == 3 and len(firsts) == 1 and m.done_seen


def test_an_anthropic_assistant_prefill_is_continued_not_a_new_turn() -> None:
    """Anthropic continues a final assistant message; the engines need vLLM's flags for it
    (before, the model started a new turn after the prefill), and the router tokenizes what
    the engine prefills: no assistant prompt after the prefill."""
    turns = [{"role": "user", "content": "json?"}, {"role": "assistant", "content": '{"a":'}]
    raw = msgspec.json.encode({"model": "m", "max_tokens": 5, "messages": turns})
    _, text, upstream, _ = decode_messages(raw)
    doc = json.loads(upstream)
    assert doc["continue_final_message"] is True and doc["add_generation_prompt"] is False
    assert text.endswith('<|assistant|> {"a":')
    assert decode_count_tokens(msgspec.json.encode({"model": "m", "messages": turns}))[1] == text
    plain = msgspec.json.encode({"model": "m", "max_tokens": 5, "messages": turns[:1]})
    _, text, upstream, _ = decode_messages(plain)
    assert "continue_final_message" not in json.loads(upstream)
    assert text.endswith("<|assistant|>")
    spaced = [turns[0], {"role": "assistant", "content": "Sure, "}]
    with pytest.raises(RequestError, match="trailing whitespace") as info:
        decode_messages(msgspec.json.encode({"model": "m", "max_tokens": 5, "messages": spaced}))
    assert info.value.param == "messages[1].content"


def test_an_openai_chat_that_continues_its_last_message_is_tokenized_as_prefilled() -> None:
    turns = [*USER, {"role": "assistant", "content": "Once"}]
    d = decode_openai(_chat(messages=turns, continue_final_message=True,
                            add_generation_prompt=False), chat=True,
                      max_output_tokens=LIMIT)  # fmt: skip
    assert d.text is not None and d.text.endswith("<|assistant|> Once")
    assert json.loads(d.upstream)["continue_final_message"] is True  # as sent
    assert decode_openai(_chat(), chat=True, max_output_tokens=LIMIT).text.endswith(  # type: ignore[union-attr]
        "<|assistant|>"
    )


def test_max_tokens_zero_scores_the_prompt_with_echo_only() -> None:
    body = {"model": "m", "prompt": "score me", "max_tokens": 0}
    with pytest.raises(RequestError, match="0 only with echo"):
        decode_openai(msgspec.json.encode(body), chat=False, max_output_tokens=LIMIT)
    d = decode_openai(msgspec.json.encode(body | {"echo": True, "logprobs": 1}), chat=False,
                      max_output_tokens=LIMIT)  # fmt: skip
    assert d.max_output_tokens is None and json.loads(d.upstream)["max_tokens"] == 0


def test_prompt_logprobs_unstreamed_is_refused_by_the_router_itself() -> None:
    """The router streams from the engine; vLLM refuses prompt_logprobs on a stream with a
    message about stream=True that the client never sent."""
    body = {"model": "m", "prompt": "hi", "prompt_logprobs": 1}
    with pytest.raises(RequestError, match="prompt_logprobs without stream") as info:
        decode_openai(msgspec.json.encode(body), chat=False, max_output_tokens=LIMIT)
    assert info.value.param == "prompt_logprobs"
    streamed = decode_openai(msgspec.json.encode(body | {"stream": True}), chat=False,
                             max_output_tokens=LIMIT)  # fmt: skip
    assert json.loads(streamed.upstream)["prompt_logprobs"] == 1


def test_an_assembled_answer_keeps_every_token_id() -> None:
    """vLLM's return_token_ids streams a piece per event; the assembled answer kept only the
    last piece (an empty list from the finish event)."""
    collected = Collected(chat=False)
    pieces = [{"index": 0, "text": "a", "token_ids": [100], "prompt_token_ids": [1, 2]},
              {"index": 0, "text": "b", "token_ids": [101, 102]},
              {"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}]  # fmt: skip
    for piece in pieces:
        collected._add({"choices": [piece]})
    choice = collected.answer("m", "r")["choices"][0]
    assert choice["token_ids"] == [100, 101, 102] and choice["prompt_token_ids"] == [1, 2]
    assert choice["text"] == "ab"


@pytest.mark.parametrize(("field", "value", "stop"), [
    ("stop_reason", "END", ("stop_sequence", "END")),  # vLLM
    ("matched_stop", "END", ("stop_sequence", "END")),  # SGLang
    ("matched_stop", 2, ("end_turn", None)),  # SGLang: a stop token (EOS)
])  # fmt: skip
def test_anthropic_stop_sequence_from_either_engine(field: str, value: Any,
                                                    stop: tuple[str, Any]) -> None:  # fmt: skip
    import asyncio

    from foretoken.adapters.http.router.anthropic import AnthropicRelay

    relay = AnthropicRelay(make_mocked_request("POST", "/v1/messages"), None, "msg_1", "m", 10)
    event = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop",
                          field: value}]}  # fmt: skip
    asyncio.run(relay.send([(msgspec.json.encode(event), None)]))
    answer = relay.answer(Measured(prompt_tokens=10, output_tokens=1, usage_seen=True))
    assert (answer["stop_reason"], answer["stop_sequence"]) == stop


def test_consecutive_anthropic_turns_of_one_role_are_one_turn() -> None:
    """Anthropic combines them; a strict chat template refuses roles that do not alternate."""
    turns = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
             {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]  # fmt: skip
    raw = msgspec.json.encode({"model": "m", "max_tokens": 5, "system": "s", "messages": turns})
    _, text, upstream, _ = decode_messages(raw)
    sent = json.loads(upstream)["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[1]["content"] == "a\n\nb" and "<|user|> a\n\nb" in text


def test_a_top_level_engine_error_event_becomes_one_the_sdks_raise_on() -> None:
    import asyncio

    from aiohttp import web

    written: list[bytes] = []

    class Sink(web.StreamResponse):
        async def write(self, data: bytes) -> None:  # type: ignore[override]
            written.append(bytes(data))

    request = make_mocked_request("POST", "/v1/completions")
    stream = OpenAIStream(request, Sink(), chat=False, wants_usage=False)
    payload = b'{"object":"error","message":"out of memory","type":"InternalServerError"}'
    asyncio.run(stream.send([(payload, read_chunk(payload))]))
    asyncio.run(stream.close(None))
    events = b"".join(written).decode()
    assert '"error": {' in events.replace('":{', '": {') and "out of memory" in events
    assert events.count("out of memory") == 1 and events.endswith("data: [DONE]\n\n")
