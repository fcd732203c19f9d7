"""Where graded requests go (house rule 5): the :class:`GradedSink` contract, and an
in-memory backend. The Parquet lake (:class:`foretoken.adapters.lake.sink.ParquetLake`) is
the other; ``tests/contract/test_sink_contract.py`` runs one suite against both.

The contract: appending is at-least-once safe — a request appended again (a re-delivery
after a restart, or a later grade of it) is read back once, as the latest written; a batch
is all-or-nothing (a record the sink cannot hold raises ``ValueError`` and nothing of that
batch is kept); compaction changes how records are stored, never what is read back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from foretoken.core.types import GradedRequest, RequestId


@runtime_checkable
class GradedSink(Protocol):
    def append(self, records: Sequence[GradedRequest]) -> int:
        """Keep ``records`` durably; returns how many storage units were written (files,
        batches: for the metrics)."""
        ...

    def compact_closed(self, now_s: float, after_s: float) -> Sequence[object]:
        """Compact what is closed for ``after_s``; returns what was compacted (one item per
        unit, printable)."""
        ...

    def latest(self) -> dict[RequestId, GradedRequest]:
        """What a reader sees: one graded request per request id, the latest written."""
        ...


class MemorySink:
    """A sink in memory (tests, demos): the latest record per request id."""

    def __init__(self) -> None:
        self._rows: dict[RequestId, GradedRequest] = {}
        self.batches = 0

    def append(self, records: Sequence[GradedRequest]) -> int:
        for record in records:
            if not math.isfinite(record.ts):
                raise ValueError(f"graded request {record.request_id}: ts must be finite")
        if not records:
            return 0
        for record in records:
            self._rows.pop(record.request_id, None)  # the latest written comes last
            self._rows[record.request_id] = record
        self.batches += 1
        return 1

    def compact_closed(self, now_s: float, after_s: float) -> Sequence[object]:
        return []

    def latest(self) -> dict[RequestId, GradedRequest]:
        return dict(self._rows)
