"""The index keeper holds KV batches of workers not registered yet, within bounds: past them
a batch is dead-lettered with its reason (the dispatcher does that for a handler that
raises), never an unbounded list in memory and in every snapshot."""

from __future__ import annotations

import pytest

from foretoken.adapters.kafka import index_keeper
from foretoken.adapters.kafka.dispatch import Position
from foretoken.adapters.kafka.index_keeper import IndexKeeper
from foretoken.core.types import ModelName, WorkerId
from foretoken.wire.records import BlockStored, KvEventBatch
from tests.unit.core.routing.test_service import BLOCK, _reg


def _batch(worker: str, seq: int) -> KvEventBatch:
    tokens = tuple(range(seq, seq + BLOCK))
    stored = BlockStored(block_hashes=(seq + 1,), token_ids=tokens, block_size=BLOCK)
    wid, model = WorkerId(worker), ModelName("m")
    return KvEventBatch(worker_id=wid, model=model, seq=seq, ts=1.0, events=(stored,))


def test_batches_wait_for_their_registration_then_apply(tmp_path) -> None:  # type: ignore[no-untyped-def]
    keeper = IndexKeeper("kv", tmp_path / "snap")
    for seq in range(3):
        keeper.on_kv(_batch("w0", seq), Position(0, seq))
    assert keeper.cache_page("m")["pending_unregistered"] == {"w0": 3}
    keeper.on_worker(_reg("w0", model="m"), Position(0, 0))
    assert keeper.pending == {}
    assert keeper.index.stats()["workers"]["w0"]["blocks"]["GPU"] == 3  # type: ignore[index]


def test_pending_batches_are_bounded_per_worker_and_in_workers(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(index_keeper, "MAX_PENDING_BATCHES", 2)
    monkeypatch.setattr(index_keeper, "MAX_PENDING_WORKERS", 2)
    keeper = IndexKeeper("kv", None)
    keeper.on_kv(_batch("w0", 0), Position(0, 0))
    keeper.on_kv(_batch("w0", 1), Position(0, 1))
    with pytest.raises(ValueError, match="already wait"):
        keeper.on_kv(_batch("w0", 2), Position(0, 2))
    keeper.on_kv(_batch("w1", 0), Position(0, 3))
    with pytest.raises(ValueError, match="unregistered workers already wait"):
        keeper.on_kv(_batch("w2", 0), Position(0, 4))
    page = keeper.cache_page("m")
    assert page["pending_unregistered"] == {"w0": 2, "w1": 1}
    assert page["pending_dead_lettered"] == 2
    keeper.on_worker(_reg("w0", model="m"), Position(0, 0))  # registered: applied, not held
    keeper.on_kv(_batch("w0", 3), Position(0, 5))
    assert "w0" not in keeper.pending
