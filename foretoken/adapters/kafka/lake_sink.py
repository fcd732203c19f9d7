"""The lake sink: the worker's thin agent from the ``graded`` topic to the Parquet lake.

When ``lake.dir`` is set (``FORETOKEN_LAKE_DIR``) this agent consumes ``graded`` in the
place of the plain one: each record still goes through the ``Dispatcher`` (decode or
dead-letter; the fits learn from it), and the decoded records are appended to the lake by
:class:`foretoken.adapters.lake.writer.LakeWriter` in batches of ``lake.batch_records`` or
``lake.batch_s``,
whichever comes first (write then rename, off the event loop).

**At least once.** The batch is taken with Faust's ``noack_take``: no event of it is acked
before the batch's files are written, fsynced and renamed into place, and Faust commits a
partition's offset only up to its first unacked event. A worker killed between the write
and the commit reads the batch again after its restart and writes it again; the lake's
views keep one row per request id (the latest written), so nothing counts twice.

**Bad input never stops it.** A record that does not decode (or fails the record's own
checks: a time polars cannot place, a NaN grade) is dead-lettered by the Dispatcher; a
batch the writer rejects is halved until the records that fail alone are found, and those
are dead-lettered with the writer's reason (and acked: never retried forever); the rest
are written. A failure that is not the records' (a full disk) dead-letters the batch.

**Compaction.** Every ``lake.compact_interval_s`` the hours closed for
``lake.compact_after_s`` that hold more than one file are merged into one (off the event
loop; readers never wait, see :mod:`foretoken.adapters.lake.writer`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faust
from prometheus_client import CollectorRegistry, Counter

from foretoken.adapters.lake.sink import ParquetLake
from foretoken.core.grading.sink import GradedSink
from foretoken.settings import LakeSettings
from foretoken.wire.records import Graded

log = logging.getLogger(__name__)

# The agent's hook for what the Dispatcher said of one event: emit, count, dead-letter.
AfterConsume = Callable[[Any, Any], Awaitable[None]]
SendDeadLetter = Callable[[Any, str], Awaitable[None]]


@dataclass
class SinkCounters:
    batches: int = 0
    records: int = 0
    files: int = 0
    failed: int = 0
    compacted_hours: int = 0
    last_write_s: float | None = None


class LakeSink:
    """The sink's plain part (no Faust): write a batch, isolate bad records, compact."""

    def __init__(self, settings: LakeSettings, registry: CollectorRegistry | None = None) -> None:
        if not settings.dir:
            raise ValueError("the lake sink needs lake.dir (FORETOKEN_LAKE_DIR)")
        if settings.batch_records < 1 or settings.batch_s <= 0:
            raise ValueError("lake.batch_records must be >= 1 and lake.batch_s > 0")
        self.settings = settings
        self.lake: GradedSink = ParquetLake(Path(settings.dir))
        self.counters = SinkCounters()
        self._written = Counter(
            "foretoken_lake_records_written",
            "Graded records appended to the Parquet lake (re-deliveries included).",
            registry=registry,
        )
        self._failed = Counter(
            "foretoken_lake_records_failed",
            "Graded records the lake writer rejected (dead-lettered).",
            registry=registry,
        )

    def write(self, records: Sequence[Graded]) -> list[tuple[int, str]]:
        """Append ``records``; returns (index, reason) of the records that could not be
        written (the rest are durably in the lake when this returns). Never raises: a
        batch that fails is halved until the records that fail alone are found (one bad
        record in 5,000 costs ~25 files, not 4,999 one-row files)."""
        failed: list[tuple[int, str]] = []
        self._write(records, 0, failed)
        if failed:
            self.counters.failed += len(failed)
            self._failed.inc(len(failed))
        return failed

    def _write(self, records: Sequence[Graded], start: int,
               failed: list[tuple[int, str]]) -> None:  # fmt: skip
        if not records:
            return
        try:
            files = self.lake.append(records)
        except BaseException as exc:  # polars panics are BaseExceptions; stops are not ours
            if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            if len(records) == 1:
                failed.append((start, f"lake write failed: {type(exc).__name__}: {exc}"[:2000]))
                return
            if start == 0 and not failed:
                log.warning("a lake batch of %d failed (%s: %s); isolating the bad records",
                            len(records), type(exc).__name__, exc)  # fmt: skip
            half = len(records) // 2
            self._write(records[:half], start, failed)
            self._write(records[half:], start + half, failed)
            return
        self._count(len(records), files)

    def _count(self, records: int, files: int) -> None:
        self.counters.batches += 1
        self.counters.records += records
        self.counters.files += files
        self.counters.last_write_s = time.time()
        self._written.inc(records)

    def compact(self, now_s: float) -> Sequence[object]:
        done = self.lake.compact_closed(now_s, self.settings.compact_after_s)
        self.counters.compacted_hours += len(done)
        return done

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "dir": self.settings.dir,
            "batches": c.batches,
            "records": c.records,
            "files": c.files,
            "failed": c.failed,
            "compacted_hours": c.compacted_hours,
            "last_write_s": c.last_write_s,
        }


def add_lake_sink(
    app: faust.App,
    sink: LakeSink,
    topic_name: str,
    consume: Callable[[Any], Any],
    after_consume: AfterConsume,
    dead_letter: SendDeadLetter,
) -> None:
    """The agent on ``topic_name`` (``graded``) and the compaction timer.

    ``consume(event)`` runs the Dispatcher on one event and returns its ``Consumed``;
    ``after_consume(event, consumed)`` does what the plain agent does with it (emit,
    count, dead-letter); ``dead_letter(event, reason)`` dead-letters a record the lake
    writer refused."""
    topic = app.topic(topic_name, key_serializer="raw", value_serializer="raw")
    settings = sink.settings

    async def sink_graded(stream: Any) -> None:
        loop = asyncio.get_running_loop()
        async for events in stream.noack_take(settings.batch_records, within=settings.batch_s):
            records: list[Graded] = []
            sources: list[Any] = []
            for event in events:
                consumed = consume(event)
                await after_consume(event, consumed)
                if isinstance(consumed.record, Graded):
                    records.append(consumed.record)
                    sources.append(event)
            try:
                failed = await loop.run_in_executor(None, sink.write, records)
            except Exception as exc:  # not the records' fault (the disk?): none is written
                log.exception("the lake sink could not write a batch of %d", len(records))
                failed = [(i, f"lake sink failed: {type(exc).__name__}: {exc}")
                          for i in range(len(records))]  # fmt: skip
            for index, reason in failed:
                await dead_letter(sources[index], reason)
            # Only now, with the batch durable (or dead-lettered), may the offsets move.
            for event in events:
                await stream.ack(event)

    sink_graded.__name__ = "sink_graded"
    app.agent(topic, name="foretoken.lake.sink")(sink_graded)

    @app.timer(interval=settings.compact_interval_s)
    async def compact_lake() -> None:
        loop = asyncio.get_running_loop()
        try:
            done = await loop.run_in_executor(None, sink.compact, time.time())
        except Exception as exc:  # compaction is an optimization: log, try again later
            log.warning("lake compaction failed: %s", exc)
            return
        for c in done:
            log.info("compacted %s", c)
