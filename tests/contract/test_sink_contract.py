"""The graded-sink contract (house rule 5), run against every backend: the Parquet lake and
the in-memory sink (:mod:`foretoken.core.grading.sink`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from foretoken.adapters.lake.sink import ParquetLake
from foretoken.core.grading.sink import GradedSink, MemorySink
from foretoken.core.types import CacheSource, GradedRequest, RequestId, WorkerId

HOUR0 = 1_767_225_600.0  # 2026-01-01T00:00Z
HOUR_S = 3600.0
BACKENDS: dict[str, Callable[[Path], GradedSink]] = {
    "parquet": lambda tmp: ParquetLake(tmp, durable=False),
    "memory": lambda tmp: MemorySink(),
}


@pytest.fixture(params=sorted(BACKENDS))
def sink(request: pytest.FixtureRequest, tmp_path: Path) -> GradedSink:
    made = BACKENDS[request.param](tmp_path)
    assert isinstance(made, GradedSink)
    return made


def graded(rid: str, ts: float, **changes: object) -> GradedRequest:
    base = GradedRequest(
        request_id=RequestId(rid), ts=ts, model="m", workload_class="chat",
        worker_id=WorkerId("w0"), status="served", admitted=True, prompt_tokens=100,
        predicted_ttft_s=1.0, actual_ttft_s=0.5, error_s=0.5, credited_cached_tokens=32,
        engine_cached_tokens=32, block_size=16, cache_disagreement=False,
        cache_source=CacheSource.EVENTS,
    )  # fmt: skip
    return msgspec.structs.replace(base, **changes)


def plain(record: GradedRequest) -> dict[str, object]:
    values = msgspec.to_builtins(record)
    values.pop("schema_version", None)
    return dict(values)


def test_every_request_reads_back_once_field_by_field(sink: GradedSink) -> None:
    records = [graded(f"r{i}", HOUR0 + 10.0 * i, prompt_tokens=100 + i) for i in range(20)]
    records.append(graded("rej", HOUR0 + 1, status="rejected", admitted=False, worker_id=None,
                          actual_ttft_s=None, error_s=None, retry_after_s=2.5))  # fmt: skip
    assert sink.append(records) >= 1
    back = sink.latest()
    assert set(back) == {r.request_id for r in records}
    for record in records:
        assert plain(back[record.request_id]) == plain(record)


def test_a_request_appended_again_reads_back_as_the_latest_written(sink: GradedSink) -> None:
    sink.append([graded("a", HOUR0), graded("b", HOUR0 + 1)])
    sink.append([graded("a", HOUR0, prompt_tokens=7)])  # a re-delivery, graded again
    back = sink.latest()
    assert len(back) == 2 and back[RequestId("a")].prompt_tokens == 7


def test_requests_in_several_hours_and_nothing_appended(sink: GradedSink) -> None:
    assert sink.append([]) == 0
    assert sink.latest() == {}
    sink.append([graded("x", HOUR0 + 5), graded("y", HOUR0 + HOUR_S + 5)])
    sink.append([graded("z", HOUR0 + 2 * HOUR_S + 5)])
    assert set(sink.latest()) == {"x", "y", "z"}


def test_compaction_never_changes_what_is_read(sink: GradedSink) -> None:
    for part in range(3):
        sink.append([graded(f"old{part}", HOUR0 + part), graded(f"new{part}", HOUR0 + HOUR_S)])
    sink.append([graded("old0", HOUR0, prompt_tokens=9)])
    before = sink.latest()
    sink.compact_closed(HOUR0 + HOUR_S + 120.0, 60.0)
    assert sink.latest() == before
    assert before[RequestId("old0")].prompt_tokens == 9


def test_a_record_the_sink_cannot_hold_fails_its_whole_batch(sink: GradedSink) -> None:
    sink.append([graded("kept", HOUR0)])
    with pytest.raises(ValueError):
        sink.append([graded("good", HOUR0 + 1), graded("bad", math.nan)])
    assert set(sink.latest()) == {"kept"}
