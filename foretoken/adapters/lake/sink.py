"""The Parquet lake as a :class:`~foretoken.core.grading.sink.GradedSink`: the lake writer
(:class:`~foretoken.adapters.lake.writer.LakeWriter`: hour partitions, write then rename)
for appending, the lake's own ``graded`` view (:mod:`foretoken.adapters.lake.views`: one
row per request id, the latest written) for reading back."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec

from foretoken.adapters.lake.views import connect, query
from foretoken.adapters.lake.writer import Compacted, LakeWriter
from foretoken.core.types import GradedRequest, RequestId
from foretoken.wire.records import Graded


class ParquetLake:
    def __init__(self, root: str | Path, *, durable: bool = True) -> None:
        self.writer = LakeWriter(Path(root), durable=durable)
        self.root = self.writer.root

    def append(self, records: Sequence[GradedRequest]) -> int:
        return len(self.writer.append(records))

    def compact_closed(self, now_s: float, after_s: float) -> list[Compacted]:
        return self.writer.compact_closed(now_s, after_s)

    def latest(self) -> dict[RequestId, GradedRequest]:
        con = connect(self.root)
        try:
            columns = [c for c in Graded.__struct_fields__]
            frame = query(con, f"SELECT {', '.join(columns)} FROM graded")
        finally:
            con.close()
        rows = msgspec.convert(frame.to_dicts(), list[Graded])
        return {row.request_id: row for row in rows}
