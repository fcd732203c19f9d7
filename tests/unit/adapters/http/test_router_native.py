"""SGLang's /generate at the router's edge, without a server: the engine's body is the
client's minus foretoken's fields, streaming; a batch and bad limits are named 400s; the
whole answer is the last event with the text and ids whole, whether the engine streams them
cumulatively (SGLang's default) or in pieces (incremental output); the stream's counts are
read from the last event's ``meta_info``."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from foretoken.adapters.http.router.native import NativeCollected, decode_generate
from foretoken.adapters.http.router.proxy import Measured, _scan
from foretoken.adapters.http.router.requests import RequestError


def test_the_engine_gets_the_clients_fields_streaming_without_foretokens() -> None:
    raw = msgspec.json.encode({"text": "hi", "sampling_params": {"max_new_tokens": 5, "x": 1},
                               "rid": "r1", "model": "m", "max_queue_wait_s": 9,
                               "return_logprob": True})  # fmt: skip
    body, upstream = decode_generate(raw, 100)
    assert body.sampling_params is not None and body.sampling_params.max_new_tokens == 5
    assert json.loads(upstream) == {"text": "hi", "sampling_params": {"max_new_tokens": 5,
                                    "x": 1}, "rid": "r1", "return_logprob": True,
                                    "stream": True}  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"text": ["a", "b"]}, "text"),
        ({"input_ids": [1, [2]]}, "input_ids"),
        ({"input_ids": []}, "text"),
        ({}, "text"),
        ({"text": "a", "input_ids": [1]}, "text"),
        (
            {"text": "a", "sampling_params": {"max_new_tokens": 101}},
            "sampling_params.max_new_tokens",
        ),
        ({"text": 5}, "text"),
        ({"text": "a", "sampling_params": {"n": 2}}, "sampling_params.n"),
    ],
)
def test_bad_bodies_are_named(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as info:
        decode_generate(msgspec.json.encode(fields), 100)
    assert info.value.param == param, info.value.message


def _event(text: str, ids: list[int], done: int, finish: Any = None) -> bytes:
    return msgspec.json.encode({"text": text, "output_ids": ids, "meta_info": {
        "finish_reason": finish, "completion_tokens": done, "prompt_tokens": 7,
        "cached_tokens": 3}})  # fmt: skip


@pytest.mark.parametrize("cumulative", [True, False])
async def test_the_whole_answer_from_either_kind_of_stream(cumulative: bool) -> None:
    c = NativeCollected()
    pieces, ids = [" a", " b", " a"], [4, 5, 4]
    for k in range(3):
        if cumulative:
            await c.send([(_event("".join(pieces[: k + 1]), ids[: k + 1], k + 1), None)])
        else:
            await c.send([(_event(pieces[k], ids[k : k + 1], k + 1), None)])
    await c.send([(_event("" if not cumulative else " a b a", [] if not cumulative else ids, 3,
                          {"type": "length", "length": 3}), None)])  # fmt: skip
    answer = c.answer()
    assert answer["text"] == " a b a" and answer["output_ids"] == [4, 5, 4]
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_the_first_token_and_the_counts_of_a_generate_stream() -> None:
    m = Measured()
    firsts: list[float] = []
    _scan([b"data: " + _event("", [], 0), b"data: " + _event(" a", [4], 1)], m, firsts.append)
    assert len(firsts) == 1 and m.usage_seen  # the first with text
    _scan([b"data: " + _event(" a b", [4, 5], 2),
           b"data: " + _event(" a b", [4, 5], 2, {"type": "stop"})], m, firsts.append)  # fmt: skip
    assert len(firsts) == 1 and m.output_tokens == 2 and m.cached_tokens == 3
    assert m.prompt_tokens == 7


def test_an_aborted_generate_is_an_error() -> None:
    m = Measured()
    _scan([b"data: " + _event(" a", [4], 1),
           b"data: " + _event(" a", [4], 1, {"type": "abort", "message": "out of memory"})],
          m, lambda _: None)  # fmt: skip
    assert m.status == "error" and m.error is not None and "out of memory" in m.error
    lenient = Measured()  # counts that are not integers are left out, not the event
    _scan([b'data: {"text":" a","meta_info":{"completion_tokens":"x"}}'], lenient, lambda _: None)
    assert lenient.first_token_s is not None and lenient.output_tokens == 0
