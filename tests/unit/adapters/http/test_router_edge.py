"""The router's edge without a server: a body decoded once (typed, strict, field-named errors),
the engine's body built from the client's raw values, the Anthropic translation, the
assembly of streamed chunks into one answer, and what a 429 tells a client."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from foretoken.adapters.http.router.anthropic import decode_count_tokens, decode_messages
from foretoken.adapters.http.router.errors import rejection, waiting_helps
from foretoken.adapters.http.router.proxy import Collected
from foretoken.adapters.http.router.requests import RequestError, decode_openai
from foretoken.core.tokenizer import chat_to_text
from foretoken.wire.records import Grant

LIMIT = 1000


def test_the_engine_gets_the_clients_values_untouched() -> None:
    raw = (
        b'{"model":"m","prompt":"hi","logprobs":5,"x":{"a":[1,2.50,"\\u00e9"]},'
        b'"max_queue_wait_s":10,"workload_class":"default","stream":false,"n":2}'
    )
    d = decode_openai(raw, chat=False, max_output_tokens=LIMIT)
    assert b'"x":{"a":[1,2.50,"\\u00e9"]}' in d.upstream and b'"logprobs":5' in d.upstream
    up = json.loads(d.upstream)
    assert up["stream"] is True and up["stream_options"] == {"include_usage": True}
    assert "max_queue_wait_s" not in up and "workload_class" not in up and up["n"] == 2
    assert d.text == "hi" and d.token_ids is None and not d.wants_usage
    ids = decode_openai(b'{"model":"m","prompt":[[5,6,7]]}', chat=False, max_output_tokens=LIMIT)
    assert ids.token_ids is not None and ids.token_ids.tolist() == [5, 6, 7]


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model":"m","prompt":"x","stream":"false"}', "stream"),
        (b'{"model":"m","prompt":[true]}', "prompt[0]"),
        (b'{"model":"m","prompt":"x","max_tokens":1001}', "max_tokens"),
        (b'{"model":"m","prompt":"x","stream_options":{"include_usage":true}}', "stream_options"),
        (b'{"model":"m"}', "prompt"),
        (b'{"prompt":"x"}', "model"),
    ],
)
def test_a_bad_field_is_named(raw: bytes, param: str) -> None:
    with pytest.raises(RequestError) as info:
        decode_openai(raw, chat=False, max_output_tokens=LIMIT)
    assert info.value.param == param and info.value.status == 400


messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant"]),
            "content": st.text(max_size=20)
            | st.none()
            | st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}),
                max_size=3,
            ),
        }
    ),
    min_size=1,
    max_size=4,
)


@given(messages)
def test_the_router_tokenizes_what_a_simulated_engine_would(msgs: list[dict[str, object]]) -> None:
    raw = msgspec.json.encode({"model": "m", "messages": msgs})
    d = decode_openai(raw, chat=True, max_output_tokens=LIMIT)
    assert d.text == chat_to_text(json.loads(d.upstream)["messages"])


def test_anthropic_messages_become_the_chat_the_engine_streams() -> None:
    raw = json.dumps(
        {
            "model": "m",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "be brief"}],
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
            "stop_sequences": ["END"],
            "temperature": 0.5,
            "metadata": {"user_id": "u1"},
        }
    ).encode()
    _, text, upstream, _ = decode_messages(raw)
    up = json.loads(upstream)
    assert up["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]  # several blocks: the chat API's text parts (the engine's template joins them)
    assert up["stop"] == ["END"] and up["user"] == "u1" and up["max_tokens"] == 5
    assert up["stream"] is True and text == chat_to_text(up["messages"])
    _, counted, _ = decode_count_tokens(b'{"model":"m","messages":[{"role":"user","content":"a"}]}')
    assert counted == chat_to_text([{"role": "user", "content": "a"}])
    with pytest.raises(RequestError, match="image"):
        decode_messages(
            b'{"model":"m","max_tokens":1,"messages":[{"role":"user","content":'
            b'[{"type":"image","source":{}}]}]}'
        )


async def test_streamed_chunks_assemble_into_one_answer_with_every_choice() -> None:
    c = Collected(chat=True)
    chunks = [
        {
            "id": "x",
            "created": 1,
            "model": "m",
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": "he"}},
                {"index": 1, "delta": {"content": "yo"}, "logprobs": {"content": [{"t": 1}]}},
            ],
        },
        {
            "choices": [
                {"index": 0, "delta": {"content": "llo"}, "finish_reason": "stop"},
                {
                    "index": 1,
                    "delta": {
                        "tool_calls": [
                            {"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a"'}}
                        ]
                    },
                    "logprobs": {"content": [{"t": 2}]},
                },
            ]
        },
        {
            "choices": [
                {
                    "index": 1,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]},
                    "finish_reason": "tool_calls",
                }
            ]
        },
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}},
    ]
    await c.send([(json.dumps(ch).encode(), None) for ch in chunks])
    answer = c.answer("m", "r")
    first, second = answer["choices"]
    assert first["message"]["content"] == "hello" and first["finish_reason"] == "stop"
    call = second["message"]["tool_calls"][0]
    assert call["id"] == "c1" and call["function"] == {"name": "f", "arguments": '{"a":1}'}
    assert second["logprobs"] == {"content": [{"t": 1}, {"t": 2}]}
    assert answer["usage"]["completion_tokens"] == 4 and answer["id"] == "x"


def _grant(**kw: object) -> Grant:
    base = {
        "request_id": "r",
        "ts": 0.0,
        "model": "m",
        "prompt_tokens": 10,
        "admitted": False,
        "reject_reason": "predicted_ttft_exceeds_bound",
        "predicted_ttft_s": 8.0,
        "queue_wait_s": 6.0,
        "prefill_s": 2.0,
        "max_queue_wait_s": 5.0,
    }
    return msgspec.convert({**base, **kw}, Grant)


def test_a_429_says_whether_waiting_can_help() -> None:
    helps = rejection(_grant(retry_after_s=1.5), anthropic=False)
    assert helps.status == 429 and helps.headers["retry-after-ms"] == "1500"
    assert helps.headers["Retry-After"] == "2" and "x-should-retry" not in helps.headers
    assert helps.headers["x-foretoken-predicted-ttft-s"] == "8.000"
    # 37 s asked of a client with a 5 s bound: the bound is what failed, and retrying is futile
    late = _grant(retry_after_s=37.0)
    assert not waiting_helps(late)
    resp = rejection(late, anthropic=True)
    assert resp.headers["x-should-retry"] == "false"
    assert resp.headers["x-foretoken-max-queue-wait-s"] == "5"
    body = json.loads(resp.body)  # type: ignore[arg-type]
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    assert "max_queue_wait_s = 5 s" in body["error"]["message"]
    assert "waiting cannot help" in body["error"]["message"]
    assert waiting_helps(_grant(retry_after_s=3.0, max_queue_wait_s=None))
