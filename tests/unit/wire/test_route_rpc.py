"""Route requests decoded with limits: every violation is a RouteRequestError naming the field
(issue 16, finding 4: `/v1/route` took token ids −1, 2⁶⁴ and 10³⁰; deep nesting raised)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foretoken.wire.route_rpc import (
    RouteLimits,
    RouteRequestError,
    decode_route_request,
    pack_token_ids,
)

LIMITS = RouteLimits(max_prompt_tokens=1000, max_output_tokens=100)
BASE = b'"request_id": "r", "model": "m"'


def _fails(body: bytes) -> RouteRequestError:
    with pytest.raises(RouteRequestError) as info:
        decode_route_request(body, LIMITS)
    assert 400 <= info.value.status < 500
    return info.value


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (b'"token_ids": [1, -1]', "token_ids"),
        (b'"token_ids": [18446744073709551616]', "token_ids"),
        (b'"token_ids": [4294967296]', "token_ids"),
        (b'"token_ids": [1e30]', "token_ids"),
        (b'"token_ids": [true]', "token_ids"),
        (b'"prompt_tokens": 1001', "prompt_tokens"),
        (b'"prompt_tokens": -5', "prompt_tokens"),
        (b'"prompt_tokens": 0', "token_ids"),
        (b'"prompt_tokens": 5, "expected_output_tokens": 101', "expected_output_tokens"),
        (b'"prompt_tokens": 5, "expected_output_tokens": 1e30', "expected_output_tokens"),
        (b'"prompt_tokens": 5, "expected_output_tokens": 0', "expected_output_tokens"),
        (b'"prompt_tokens": 5, "max_queue_wait_s": 1e400', "max_queue_wait_s"),
        (b'"prompt_tokens": 5, "max_queue_wait_s": -1', "max_queue_wait_s"),
        (b'"prompt_tokens": 5, "already_waited_s": 1e9', "already_waited_s"),
        (b'"prompt_tokens": 5, "prefer_cache_hit": "no"', "prefer_cache_hit"),
        (b'"prompt_tokens": 5, "workload_class": ["a"]', "workload_class"),
        (b'"packed_token_ids": "AAA="', "packed_token_ids"),
    ],
)
def test_each_violation_names_its_field(extra: bytes, field: str) -> None:
    error = _fails(b"{" + BASE + b", " + extra + b"}")
    assert error.field == field and field in error.message


def test_the_body_as_a_whole() -> None:
    assert _fails(b"\xff\xfe").field is None
    assert _fails(b'{"request_id": "\xed\xa0\x80", "model": "m", "prompt_tokens": 1}')
    deep = b"{" + BASE + b', "prompt_tokens": 1, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert "deeply" in _fails(deep).message
    assert _fails(b'{"request_id": ["r"], "model": "m", "prompt_tokens": 1}').field == "request_id"
    assert _fails(b'{"model": "m", "prompt_tokens": 1}').field == "request_id"
    assert _fails(b'{"request_id": "' + b"x" * 300 + b'", "model": "m"}').field == "request_id"


def test_packed_prompts_over_the_limit_and_good_requests() -> None:
    packed = msgspec.msgpack.encode(
        {"request_id": "r", "model": "m", "packed_token_ids": pack_token_ids(range(1001))}
    )
    assert _fails(packed).field == "packed_token_ids"
    good = msgspec.msgpack.encode(
        {"request_id": "r", "model": "m", "packed_token_ids": pack_token_ids([0, 2**32 - 1])}
    )
    request = decode_route_request(good, LIMITS)
    assert list(request.tokens()) == [0, 2**32 - 1] and request.prompt_length == 2


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
FIELDS = ["request_id", "model", "token_ids", "prompt_tokens", "max_queue_wait_s",
          "already_waited_s", "workload_class", "prefer_cache_hit", "conversation_id",
          "expected_output_tokens", "packed_token_ids", "schema_version"]  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(body=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8))
def test_any_json_object_is_a_request_or_a_4xx(body: dict[str, object]) -> None:
    raw = msgspec.json.encode(body)
    try:
        request = decode_route_request(raw, LIMITS)
    except RouteRequestError as exc:
        assert 400 <= exc.status < 500
        return
    assert 0 < request.prompt_length <= LIMITS.max_prompt_tokens
    request.query()  # the core takes it as it is
