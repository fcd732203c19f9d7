"""Splitting a batch into kv-events records below the producer's limit: every record fits,
and the records, applied in order, change the index exactly as the whole batch would."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foretoken.adapters.engines.emitter import dead_letter_value
from foretoken.adapters.engines.split import encode_records
from foretoken.core.index.prefix import PrefixIndex
from foretoken.core.types import ModelName, WorkerId
from foretoken.settings import load_settings
from foretoken.wire.codec import decode
from foretoken.wire.records import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    DeadLetter,
    KvEvent,
    KvEventBatch,
    WireFormat,
)
from foretoken.wire.route_rpc import pack_token_ids

W, M, BS = WorkerId("w"), ModelName("m"), 4


def _batch(events: list[KvEvent]) -> KvEventBatch:
    return KvEventBatch(worker_id=W, model=M, seq=7, ts=1.0, events=tuple(events))


def _index() -> PrefixIndex:
    index = PrefixIndex()
    index.register_worker(W, M, BS)
    return index


def _chain(first: int, blocks: int, salt: str | None = None, packed: bool = False) -> BlockStored:
    """Token ids as ints, or ``packed`` as the ingest decoder writes them."""
    tokens = tuple((first * 7 + i) % 50_000 for i in range(blocks * BS))
    return BlockStored(
        block_hashes=tuple(range(first, first + blocks)),
        token_ids=() if packed else tokens,
        packed_token_ids=pack_token_ids(tokens) if packed else b"",
        block_size=BS,
        extra_keys=(f'["{salt}"]',) + ("",) * (blocks - 1) if salt else (),
    )


def _applied(batches: list[KvEventBatch]) -> PrefixIndex:
    index = _index()
    for b in batches:
        index.apply(b, 0.0)
    return index


def _same(a: PrefixIndex, b: PrefixIndex, prompts: list[list[int]]) -> None:
    assert a.stats()["workers"] == b.stats()["workers"]
    for p in prompts:
        assert a.lookup(M, p)[W] == b.lookup(M, p)[W]


def test_a_small_batch_is_one_record() -> None:
    records = encode_records(_batch([_chain(1, 3)]), 10_000, "json")
    assert len(records.values) == 1 and not records.split and not records.dropped


@pytest.mark.parametrize("packed", [False, True])
def test_a_huge_store_is_cut_into_chained_pieces_that_index_the_same(packed: bool) -> None:
    event = _chain(1000, 5000, salt="tenant", packed=packed)
    batch = _batch([event, BlockRemoved(block_hashes=(1000, 1001)), AllCleared(medium="CPU")])
    for fmt in ("json", "msgpack"):
        records = encode_records(batch, 32 * 1024, fmt)  # type: ignore[arg-type]
        assert records.split and not records.dropped
        assert all(len(v) <= 32 * 1024 for v in records.values)
        parts = [decode(v, KvEventBatch) for v in records.values]
        assert {(p.worker_id, p.seq, p.ts) for p in parts} == {(W, 7, 1.0)}
        prompt = event.token_id_list()
        _same(_applied([batch]), _applied(parts), [prompt, prompt[: 40 * BS]])


events = st.lists(
    st.one_of(
        st.builds(
            _chain,
            st.integers(1, 10**6),
            st.integers(1, 400),
            st.sampled_from([None, "s"]),
            st.booleans(),
        ),
        st.builds(
            lambda n, k: BlockRemoved(block_hashes=tuple(range(n, n + k))),
            st.integers(1, 10**6),
            st.integers(1, 300),
        ),
        st.just(AllCleared()),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=events, limit=st.integers(2_000, 40_000), fmt=st.sampled_from(["json", "msgpack"]))
def test_records_fit_and_apply_like_the_batch(
    events: list[KvEvent], limit: int, fmt: WireFormat
) -> None:
    batch = _batch(events)
    records = encode_records(batch, limit, fmt)
    assert not records.dropped and all(len(v) <= limit for v in records.values)
    parts = [decode(v, KvEventBatch) for v in records.values]
    prompts = [e.token_id_list() for e in events if isinstance(e, BlockStored)]
    _same(_applied([batch]), _applied(parts), prompts)


def test_a_block_bigger_than_any_record_is_reported_not_raised() -> None:
    one = BlockStored(block_hashes=(1,), token_ids=tuple(range(50_000)), block_size=50_000)
    records = encode_records(_batch([_chain(1, 2), one]), 20_000, "json")
    assert len(records.dropped) == 1 and "exceeds" in records.dropped[0]
    assert [len(decode(v, KvEventBatch).events) for v in records.values] == [1]


def test_a_dead_letter_is_cut_to_fit_whatever_it_carries() -> None:
    settings_ = load_settings(env={})
    for fmt in ("json", "msgpack"):
        s = settings_.__class__(wire_format=fmt)  # type: ignore[arg-type]
        value = dead_letter_value("zmq:w", "x" * 50_000, b"\xff" * 5_000_000, 100_000, s)
        assert value is not None and len(value) <= 100_000
        letter = decode(value, DeadLetter)
        assert letter.payload_size == 5_000_000 and 0 < len(letter.payload) < 100_000
        assert len(letter.reason) <= 2000
        small = decode(dead_letter_value("s", "r", b"abc", 100_000, s) or b"", DeadLetter)
        assert small.payload == b"abc" and small.payload_size is None
    assert dead_letter_value("s", "r", b"", 10, settings_) is None  # nothing fits 10 bytes
