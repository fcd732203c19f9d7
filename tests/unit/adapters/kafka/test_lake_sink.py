"""The lake sink's plain parts: batches into the lake (bad records isolated, re-deliveries
counted once), compaction of closed hours only, and the acks held for the grading join."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from foretoken.adapters.kafka.held_acks import HeldAcks
from foretoken.adapters.kafka.lake_sink import LakeSink
from foretoken.adapters.lake.sink import ParquetLake
from foretoken.adapters.lake.views import connect, rows
from foretoken.adapters.lake.writer import (
    HOUR_S,
    Compacted,
    closed_hours,
    hour_dirs,
    hour_start_s,
    part_files,
)
from foretoken.core.types import RequestId
from foretoken.settings import LakeSettings
from foretoken.wire.records import Graded

HOUR0 = 1_767_225_600.0  # 2026-01-01T00:00Z


def _graded(rid: str, ts: float, status: str = "served", error: float = 0.5) -> Graded:
    served = status == "served"
    return Graded(
        request_id=RequestId(rid), ts=ts, model="m", workload_class="chat", worker_id="w0",
        status=status, admitted=status != "rejected", prompt_tokens=100,  # type: ignore[arg-type]
        predicted_ttft_s=1.0, actual_ttft_s=1.0 - error if served else None,
        error_s=error if served else None,
    )  # fmt: skip


def _count(lake: Path, view: str) -> int:
    con = connect(lake)
    try:
        return int(rows(con, f"SELECT count(*) AS n FROM {view}")[0]["n"])
    finally:
        con.close()


def _sink(lake: Path, **kw: Any) -> LakeSink:
    return LakeSink(LakeSettings(dir=str(lake), **kw))


def test_a_batch_lands_in_the_lake_and_a_redelivery_counts_once(tmp_path: Path) -> None:
    sink = _sink(tmp_path)
    batch = [_graded(f"r{i}", HOUR0 + 10 * i) for i in range(20)]
    assert sink.write(batch) == []
    assert sink.write(batch[5:12]) == []  # the same records again (a restart re-reads them)
    assert _count(tmp_path, "graded") == 20
    assert _count(tmp_path, "graded_raw") == 27
    assert sink.stats()["records"] == 27 and sink.stats()["failed"] == 0


def test_the_latest_written_record_of_a_request_wins(tmp_path: Path) -> None:
    sink = _sink(tmp_path)
    sink.write([_graded("r", HOUR0, status="missing_outcome")])
    sink.write([_graded("r", HOUR0, status="served", error=0.25)])
    con = connect(tmp_path)
    try:
        found = rows(con, "SELECT status, error_s FROM graded")
    finally:
        con.close()
    assert found == [{"status": "served", "error_s": 0.25}]


class _Panic(BaseException):
    """What polars raises when it panics (its PanicException is a BaseException)."""


class _Picky:
    """The lake, except that a batch holding a record named "bad" panics as polars did on
    a timestamp it could not place."""

    def __init__(self, lake: Any) -> None:
        self.lake, self.calls = lake, 0

    def append(self, records: Any) -> int:
        self.calls += 1
        if any(r.request_id.startswith("bad") for r in records):
            raise _Panic("out of range")
        return int(self.lake.append(records))


def test_a_record_the_writer_rejects_is_isolated_and_reported(tmp_path: Path) -> None:
    """Before: a panic (a BaseException) escaped the sink and the batch was lost; and one bad
    record in a batch made one file per record."""
    sink = _sink(tmp_path)
    picky = _Picky(sink.lake)
    sink.lake = picky  # type: ignore[assignment]
    batch = [_graded(f"r{i}", HOUR0 + i) for i in range(64)]
    batch[37] = _graded("bad37", HOUR0)
    failed = sink.write(batch)
    assert [index for index, _ in failed] == [37]
    assert failed[0][1].startswith("lake write failed: _Panic")
    assert _count(tmp_path, "graded") == 63
    assert sink.stats()["failed"] == 1 and sink.stats()["files"] <= 12  # not 63 one-row files
    assert picky.calls <= 13


def test_a_graded_record_with_a_time_or_grade_the_lake_cannot_take_is_refused() -> None:
    """The graded topic is read by the sink: a stranger's record with a time polars cannot
    place (it panicked) or a NaN grade (it skewed within_1s) never reaches the writer."""
    with pytest.raises(ValueError, match="ts"):
        _graded("x", 9.0e12)
    with pytest.raises(ValueError, match="ts must be finite"):
        _graded("x", math.inf)
    with pytest.raises(ValueError, match="must be finite"):
        _graded("x", HOUR0, error=math.nan)


def test_the_sink_needs_a_directory_and_sane_batches(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"lake\.dir"):
        LakeSink(LakeSettings())
    with pytest.raises(ValueError, match="batch"):
        _sink(tmp_path, batch_records=0)


def test_closed_hours_are_those_ended_long_enough_ago() -> None:
    hours = ["2026-01-01T00", "2026-01-01T01", "2026-01-01T02", "not-an-hour"]
    assert hour_start_s("2026-01-01T01") == HOUR0 + HOUR_S
    now = HOUR0 + 2 * HOUR_S + 100.0  # 100 s into hour 02
    assert closed_hours(hours, now, after_s=0.0) == ["2026-01-01T00", "2026-01-01T01"]
    assert closed_hours(hours, now, after_s=300.0) == ["2026-01-01T00"]


def test_compaction_merges_closed_hours_and_leaves_the_open_one(tmp_path: Path) -> None:
    sink = _sink(tmp_path, compact_after_s=60.0)
    for part in range(3):  # three appends into each of two hours
        sink.write([_graded(f"old{part}", HOUR0 + part), _graded(f"new{part}", HOUR0 + HOUR_S)])
    sink.write([_graded("old0", HOUR0)])  # a re-delivery into the closed hour
    done = sink.compact(now_s=HOUR0 + HOUR_S + 120.0)  # hour 00 closed 120 s ago
    assert all(isinstance(c, Compacted) for c in done)
    assert [(c.hour, c.merged_files, c.rows_in, c.rows_out) for c in done] == [  # type: ignore[attr-defined]
        ("2026-01-01T00", 4, 4, 3)
    ]
    files = {hour: len(part_files(d)) for hour, d in hour_dirs(tmp_path).items()}
    assert files == {"2026-01-01T00": 1, "2026-01-01T01": 3}
    assert _count(tmp_path, "graded") == 6 and _count(tmp_path, "graded_raw") == 6
    assert isinstance(sink.lake, ParquetLake)


class _Stream:
    def __init__(self) -> None:
        self.acked: list[str] = []

    async def ack(self, event: str) -> bool:
        self.acked.append(event)
        return True


def test_acks_wait_until_the_join_settles_the_request() -> None:
    pending: set[RequestId] = set()
    held = HeldAcks(lambda: pending)
    grants, outcomes = _Stream(), _Stream()
    r1, r2, r3 = RequestId("r1"), RequestId("r2"), RequestId("r3")

    async def scenario() -> None:
        pending.add(r1)
        await held.after(grants, "grant-r1", 0, r1)  # waits for its completion
        await held.after(outcomes, "first-r1", 0, r1)
        await held.after(grants, "grant-r2", 1, r2)  # settled at once, another partition
        await held.after(grants, "junk", 1, None)  # undecodable: dead-lettered, acked
        assert grants.acked == ["grant-r2", "junk"] and outcomes.acked == []
        assert len(held) == 2
        pending.discard(r1)  # the completion came: graded
        await held.after(outcomes, "done-r1", 0, r1)
        assert grants.acked == ["grant-r2", "junk", "grant-r1"]
        assert outcomes.acked == ["first-r1", "done-r1"]  # in offset order
        pending.add(r3)
        await held.after(grants, "grant-r3", 0, r3)
        pending.clear()  # expired by the join's timeout
        assert await held.release_settled() == 1
        assert grants.acked[-1] == "grant-r3" and len(held) == 0

    asyncio.run(scenario())


def test_a_settled_event_is_not_acked_before_an_earlier_open_one() -> None:
    """Faust commits past an unacked event at the committed offset; so acks are kept a
    contiguous prefix of each partition's offsets."""
    pending: set[RequestId] = {RequestId("slow")}
    held = HeldAcks(lambda: pending)
    grants = _Stream()

    async def scenario() -> None:
        await held.after(grants, "grant-slow", 0, RequestId("slow"))
        await held.after(grants, "grant-fast", 0, RequestId("fast"))  # settled (rejected)
        await held.after(grants, "grant-other", 2, RequestId("other"))
        assert grants.acked == ["grant-other"]  # partition 0 waits behind "slow"
        pending.clear()
        await held.release_settled()
        assert grants.acked == ["grant-other", "grant-slow", "grant-fast"]

    asyncio.run(scenario())
