"""Round trips and boundary validation of every wire record."""

from __future__ import annotations

import enum
import json
import types
import typing
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from foretoken.core.checks import U64_MASK
from foretoken.core.types import TIERS
from foretoken.wire.codec import DecodeError, decode, encode, normalize_engine_hash
from foretoken.wire.records import (
    RECORD_TYPES,
    SCHEMA_VERSION,
    BlockStored,
    Grant,
    KvEventBatch,
    Outcome,
    Record,
    WorkerRegistration,
)

FINITE = st.floats(min_value=0, max_value=1e5, allow_nan=False, allow_infinity=False)
# Counts of tokens and the like are bounded by the records' checks (far below 2^63).
COUNT = st.integers(0, 1 << 20)
MAX_I64 = (1 << 63) - 1
# Fields whose valid values a generic strategy would rarely hit (bounded sizes, URLs, a
# non-empty set of tiers).
NAMED: dict[str, st.SearchStrategy[Any]] = {
    "url": st.just("http://127.0.0.1:1"),
    "tiers": st.lists(st.sampled_from(TIERS), min_size=1, max_size=4, unique=True).map(tuple),
    **{
        name: st.integers(1, 1 << 20)
        for name in ("gpu_blocks", "max_model_len", "max_num_seqs", "max_num_batched_tokens")
    },
    "long_prefill_token_threshold": COUNT,
}


def strategy_for(tp: Any) -> st.SearchStrategy[Any]:
    """A strategy of wire-valid values for a record field's type (64-bit ints, finite floats)."""
    if hasattr(tp, "__supertype__"):  # NewType
        return strategy_for(tp.__supertype__)
    simple: dict[Any, st.SearchStrategy[Any]] = {
        int: st.integers(0, MAX_I64),
        float: FINITE,
        str: st.text(max_size=8),
        bool: st.booleans(),
        bytes: st.binary(max_size=16),
        type(None): st.none(),
    }
    if tp in simple:
        return simple[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if origin is tuple:
        return st.lists(strategy_for(args[0]), max_size=4).map(tuple)
    if isinstance(tp, types.UnionType) or origin is typing.Union:
        return st.one_of([strategy_for(a) for a in args])
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        hints = typing.get_type_hints(tp)
        fields = {f.name: NAMED[f.name] if f.name in NAMED else
                  COUNT if _is_count(f.name, hints[f.name]) else strategy_for(hints[f.name])
                  for f in msgspec.structs.fields(tp)}  # fmt: skip
        fields.pop("schema_version", None)
        return st.builds(tp, **fields)
    raise TypeError(f"no strategy for {tp!r}")


def _is_count(name: str, tp: Any) -> bool:
    counts = ("_tokens", "tokens_ahead", "_samples", "samples", "block_size")
    return name.endswith(counts) and tp in (int, int | None)


@st.composite
def valid_records(draw: st.DrawFn, cls: type[Record]) -> Record:
    try:
        return draw(strategy_for(cls))
    except ValueError:  # __post_init__ rejected a combination: not a valid record
        assume(False)
        raise


@pytest.mark.parametrize("logical", sorted(RECORD_TYPES))
@pytest.mark.parametrize("wire", ["json", "msgpack"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_record_round_trips(logical: str, wire: str, data: st.DataObject) -> None:
    cls = RECORD_TYPES[logical]
    record = data.draw(valid_records(cls))
    assert decode(encode(record, wire), cls) == record


@given(st.binary())
def test_garbage_bytes_raise_only_decode_error(blob: bytes) -> None:
    for cls in RECORD_TYPES.values():
        try:
            decode(blob, cls)
        except DecodeError as exc:
            assert exc.reason
        # decoding garbage into a valid record is allowed only if it really is one


def test_wrong_types_say_where() -> None:
    with pytest.raises(DecodeError, match=r"request_id"):
        decode(b'{"request_id": 42, "ts": 1, "model": "m", "prompt_tokens": 1}', Grant)


def test_future_schema_version_is_refused() -> None:
    g = Grant(request_id="r", ts=1.0, model="m", prompt_tokens=1, admitted=False)
    raw = msgspec.json.decode(encode(g))
    raw["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(DecodeError, match="schema_version"):
        decode(msgspec.json.encode(raw), Grant)


def test_semantic_checks_at_the_boundary() -> None:
    with pytest.raises(DecodeError, match="names its worker"):
        decode(b'{"request_id":"r","ts":1,"model":"m","prompt_tokens":3,"admitted":true}', Grant)
    with pytest.raises(DecodeError, match="actual_ttft_s"):
        decode(
            b'{"request_id":"r","ts":1,"kind":"first_token","worker_id":"w","status":"ok"}',
            Outcome,
        )
    with pytest.raises(DecodeError, match="empty"):
        decode(b"", Grant)


def test_kv_event_union_is_tagged_by_type() -> None:
    raw = (
        b'{"worker_id":"w","model":"m","seq":3,"ts":1.5,"events":['
        b'{"type":"stored","block_hashes":[18446744073709551615],"block_size":16},'
        b'{"type":"removed","block_hashes":[1]},{"type":"cleared"},'
        b'{"type":"reset","reason":"gap"}]}'
    )
    batch = decode(raw, KvEventBatch)
    assert [type(e).__name__ for e in batch.events] == [
        "BlockStored",
        "BlockRemoved",
        "AllCleared",
        "IndexReset",
    ]
    assert batch.events[0].block_hashes == (U64_MASK,)  # type: ignore[union-attr]
    with pytest.raises(DecodeError):
        decode(raw.replace(b'"cleared"', b'"exploded"'), KvEventBatch)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (U64_MASK, U64_MASK),
        (-1, U64_MASK),
        (-(1 << 63), 1 << 63),
        (bytes(24) + (5).to_bytes(8, "big"), 5),
    ],
)
def test_engine_hashes_normalize_to_u64(value: int | bytes, expected: int) -> None:
    assert normalize_engine_hash(value) == expected


@pytest.mark.parametrize("bad", [1 << 64, -(1 << 63) - 1, b"", True])
def test_out_of_range_hashes_are_refused(bad: int | bytes) -> None:
    with pytest.raises(DecodeError):
        normalize_engine_hash(bad)


def test_a_route_request_carries_its_tokens_packed() -> None:
    from foretoken.wire.codec import decode, encode
    from foretoken.wire.route_rpc import RouteRequest, pack_token_ids

    ids = [0, 1, 50_000, 2**32 - 1]
    req = RouteRequest(request_id="r", model="m", packed_token_ids=pack_token_ids(ids))
    for wire in ("json", "msgpack"):
        back = decode(encode(req, wire), RouteRequest)
        assert list(back.tokens()) == ids and back.prompt_length == 4
    with pytest.raises(DecodeError, match="4 bytes per token"):
        decode(b'{"request_id":"r","model":"m","packed_token_ids":"AAAA"}', RouteRequest)
    both = {"request_id": "r", "model": "m", "token_ids": [1], "packed_token_ids": "AAAAAA=="}
    with pytest.raises(DecodeError, match="not both"):
        decode(json.dumps(both).encode(), RouteRequest)


def test_a_store_carries_its_tokens_packed_and_old_records_still_decode() -> None:
    from foretoken.wire.route_rpc import pack_token_ids

    ids = [0, 7, 150_000, 2**32 - 1]
    stored = BlockStored(block_hashes=(1,), packed_token_ids=pack_token_ids(ids), block_size=4)
    batch = KvEventBatch(worker_id="w", model="m", seq=1, ts=0.0, events=(stored,))
    for wire in ("json", "msgpack"):
        (back,) = decode(encode(batch, wire), KvEventBatch).events
        assert isinstance(back, BlockStored)
        assert back.token_id_list() == ids and back.token_count == 4 and not back.token_ids
    old = {
        "worker_id": "w",
        "model": "m",
        "seq": 1,
        "ts": 0.0,
        "schema_version": 1,
        "events": [{"type": "stored", "block_hashes": [1], "token_ids": ids, "block_size": 4}],
    }
    (back,) = decode(json.dumps(old).encode(), KvEventBatch).events
    assert isinstance(back, BlockStored) and back.tokens == tuple(ids) and back.token_count == 4
    event = old["events"][0]  # type: ignore[index]
    for bad, reason in (({"packed_token_ids": "AAAA"}, "4 bytes per token"),
                        ({"packed_token_ids": "AAAAAA=="}, "not both")):  # fmt: skip
        fields = {**event, **bad} if reason == "not both" else {**event, "token_ids": [], **bad}
        with pytest.raises(DecodeError, match=reason):
            decode(json.dumps({**old, "events": [fields]}).encode(), KvEventBatch)


_REG = {"worker_id": "w", "model": "m", "engine": "vllm", "engine_version": "1", "block_size": 16,
        "config_hash": "c", "ts": 1.0, "endpoints": {"http_url": "http://127.0.0.1:1"}}  # fmt: skip


@pytest.mark.parametrize(
    "change",
    [{"worker_id": "x" * 5000}, {"model": "m" * 2000}, {"engine_version": "v" * 2000},
     {"gpu_blocks": 1 << 62}, {"max_model_len": 1 << 62}, {"tiers": []},
     {"tiers": ["GPU", "GPU"]}, {"lora_adapters": [""]}, {"lora_adapters": ["a" * 2000]},
     {"lora_adapters": [f"l{i}" for i in range(5000)]},
     {"scheduler": {"max_num_seqs": 1 << 62}},
     {"scheduler": {"max_num_batched_tokens": 1 << 62}},
     {"scheduler": {"long_prefill_token_threshold": 1 << 62}}],
)  # fmt: skip
def test_absurd_registrations_are_refused(change: dict[str, Any]) -> None:
    """A worker id past the id bound once got into the route service's book and made every
    decision for its model fail (a bare 500): such a registration is dead-lettered."""
    with pytest.raises(DecodeError):
        decode(json.dumps({**_REG, **change}).encode(), WorkerRegistration)
    decode(json.dumps(_REG).encode(), WorkerRegistration)  # the base record is fine


@pytest.mark.parametrize("ts", [float("nan"), float("-inf"), -1e300, -5.0, 1e300])
def test_kv_batches_need_a_real_time(ts: float) -> None:
    """Engine steps are timed from consecutive batches' stamps: a NaN or negative stamp is
    dead-lettered, not consumed."""
    raw = msgspec.msgpack.encode({"worker_id": "w", "model": "m", "seq": 1, "ts": ts,
                                  "events": []})  # fmt: skip
    with pytest.raises(DecodeError, match="ts"):
        decode(raw, KvEventBatch)
    decode(b'{"worker_id":"w","model":"m","seq":1,"ts":5,"events":[]}', KvEventBatch)
