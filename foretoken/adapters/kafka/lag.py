"""How far a processor is behind its input topics, and whether it is ready to answer.

The **lag** of a topic is the number of records between what the processor has applied and
the end of the partitions it is assigned, summed over those partitions: per partition, the
end offset (measured every ``worker.lag_interval_s`` with a consumer of no group) minus the
next offset to apply (the offset after the last record handled, or — before the first one
— where the partition was started: the offset committed at the assignment, read back from
the group). A partition whose end is not measured yet counts as unknown, and unknown is not
caught up.

**Readiness** (``/healthz``): a route replica is ``catching_up`` (503) from each assignment
until every input topic's lag is at most ``worker.ready_lag_records`` — and ``workers`` is
read to its end (a replica that misses a registration would answer "no worker for this
model" for a worker everyone else routes to) —, then ``ok``; past
that it reports ``lagging`` (503) only when the lag stays above the bound for
``worker.lagging_after_s`` (a burst does not take it out of a router's rotation). The primary
answers 200 always (it is the processor of today; the same figures are in its body).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from foretoken.settings import Settings

log = logging.getLogger(__name__)
Readiness = Literal["catching_up", "ok", "lagging"]
TP = tuple[str, int]


@dataclass
class LagTracker:
    """Positions, end offsets and readiness; pure of Kafka (the refresher feeds it)."""

    topics: dict[str, str]  # full topic name -> logical name, the topics that count
    bound: int
    lagging_after_s: float
    exact: frozenset[str] = frozenset()  # logical topics whose lag must be 0 (``workers``)
    positions: dict[TP, int] = field(default_factory=dict)
    ends: dict[TP, int] = field(default_factory=dict)
    assigned: set[TP] = field(default_factory=set)
    caught_up_at: float | None = None  # since the last assignment
    above_since: float | None = None  # lag above the bound since (after catching up)
    assignments = 0

    def assign(self, tps: Iterable[TP], starts: Mapping[TP, int] | None = None) -> None:
        """A new assignment (and where its partitions start, when known): catching up."""
        self.assigned = {tp for tp in tps if tp[0] in self.topics}
        self.positions = {tp: off for tp, off in self.positions.items() if tp in self.assigned}
        self.positions.update({tp: off for tp, off in (starts or {}).items()
                               if tp in self.assigned})  # fmt: skip
        self.ends = {tp: off for tp, off in self.ends.items() if tp in self.assigned}
        self.caught_up_at = None
        self.above_since = None
        self.assignments += 1

    def consumed(self, topic: str, partition: int | None, offset: int | None) -> None:
        if partition is not None and offset is not None:
            self.positions[(topic, partition)] = offset + 1

    def unknown_positions(self) -> list[TP]:
        return [tp for tp in self.assigned if tp not in self.positions]

    def update(self, ends: Mapping[TP, int], starts: Mapping[TP, int], now_s: float) -> None:
        """End offsets just measured, and start positions read back for partitions that
        have had no record yet."""
        self.ends.update({tp: off for tp, off in ends.items() if tp in self.assigned})
        for tp, off in starts.items():
            self.positions.setdefault(tp, off)
        total = self.lag()
        bound = {t: 0 if t in self.exact else self.bound for t in total}
        within = bool(self.assigned) and all(
            v is not None and v <= bound[t] for t, v in total.items()
        )
        if self.caught_up_at is None:
            if within:
                self.caught_up_at = now_s
            return
        if within:
            self.above_since = None
        elif self.above_since is None:
            self.above_since = now_s

    def lag(self) -> dict[str, int | None]:
        """Per logical topic: records not applied yet (None: not measured yet)."""
        out: dict[str, int | None] = dict.fromkeys(self.topics.values(), 0)
        for tp in self.assigned:
            logical = self.topics[tp[0]]
            end, pos = self.ends.get(tp), self.positions.get(tp)
            if end is None or pos is None or out[logical] is None:
                out[logical] = None
                continue
            out[logical] = (out[logical] or 0) + max(0, end - pos)
        return out

    def readiness(self, now_s: float) -> Readiness:
        if self.caught_up_at is None:
            return "catching_up"
        if self.above_since is not None and now_s - self.above_since >= self.lagging_after_s:
            return "lagging"
        return "ok"

    def describe(self, now_s: float) -> dict[str, object]:
        return {
            "status": self.readiness(now_s),
            "lag": self.lag(),
            "lag_bound": self.bound,
            "partitions": sorted({p for _, p in self.assigned}),
            "caught_up_s": None if self.caught_up_at is None
            else round(now_s - self.caught_up_at, 3),
            "assignments": self.assignments,
        }  # fmt: skip


async def refresh_lag(settings: Settings, tracker: LagTracker) -> None:
    """Measure the end offsets of the assigned partitions forever (a background task), and
    read back where partitions without a record yet start (the group's committed offset)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka.bootstrap_servers,
        group_id=settings.group_id,  # only to read its committed offsets: it never joins
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        while True:
            await asyncio.sleep(settings.worker.lag_interval_s)
            tps = [TopicPartition(t, p) for t, p in sorted(tracker.assigned)]
            if not tps:
                continue
            try:
                ends = await consumer.end_offsets(tps)
                starts: dict[TP, int] = {}
                fresh: list[TopicPartition] = []  # nothing committed: the start of the log
                for t, p in tracker.unknown_positions():
                    committed = await consumer.committed(TopicPartition(t, p))
                    if committed is None:
                        fresh.append(TopicPartition(t, p))
                    else:
                        starts[(t, p)] = committed
                if fresh:
                    begins = await consumer.beginning_offsets(fresh)
                    starts |= {(tp.topic, tp.partition): off for tp, off in begins.items()}
            except KafkaError as exc:
                log.info("lag not measured (%s)", exc)
                continue
            tracker.update({(tp.topic, tp.partition): off for tp, off in ends.items()},
                           starts, time.time())  # fmt: skip
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop()
