"""Records whose one value would poison a worker's predictions are refused when decoded
(so the dispatcher dead-letters them before any handler runs): a block size of 2^40 (the
prompt hash then asked for 4 TB and aborted the processor, again after every restart), a
NaN or year-3000 timestamp, a 10^12-token grant, a TTFT of 10^9 s."""

from __future__ import annotations

import msgspec
import pytest

from foretoken.wire.codec import decode, encode
from foretoken.wire.records import Grant, Outcome, WorkerRegistration

GOOD_GRANT = {"request_id": "r", "ts": 1.7e9, "model": "m", "prompt_tokens": 10,
              "admitted": False}  # fmt: skip
GOOD_OUTCOME = {"request_id": "r", "ts": 1.7e9, "kind": "first_token", "worker_id": "w",
                "actual_ttft_s": 0.5}  # fmt: skip


def _raw(record: dict[str, object]) -> bytes:
    return msgspec.msgpack.encode(record)  # msgpack carries NaN, JSON would not


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        (Grant, {"ts": float("nan")}),
        (Grant, {"ts": 3.25e10}),
        (Grant, {"prompt_tokens": 10**12}),
        (Outcome, {"ts": 3.25e10}),
        (Outcome, {"ts": float("inf")}),
        (Outcome, {"actual_ttft_s": 1e9}),
    ],
)
def test_poisonous_values_are_refused(kind: type, fields: dict[str, object]) -> None:
    base = GOOD_GRANT if kind is Grant else GOOD_OUTCOME
    decode(_raw(base), kind)  # the record without them is fine
    with pytest.raises((msgspec.ValidationError, ValueError)):
        decode(_raw({**base, **fields}), kind)


def test_a_registration_with_a_huge_block_size_is_refused() -> None:
    from tests.unit.core.routing.test_service import _reg

    reg = _reg("w0")
    raw = msgspec.msgpack.encode({**msgspec.to_builtins(reg), "block_size": 1 << 40})
    assert decode(encode(reg, "msgpack"), WorkerRegistration).block_size == reg.block_size
    with pytest.raises((msgspec.ValidationError, ValueError), match="block_size"):
        decode(raw, WorkerRegistration)
