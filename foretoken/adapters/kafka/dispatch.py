"""Decode-or-dead-letter for every input topic: the one boundary every agent goes through.

Pure of Kafka: an agent hands the raw bytes here and gets back either a validated record or
a ``DeadLetter`` to produce. Handlers (the cache index, the join, the sink …) are plain
callables registered per logical topic; one that raises dead-letters the record and the
agent carries on, so bad input never stops a consumer and never blocks other data.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from foretoken.wire.codec import DecodeError, decode
from foretoken.wire.records import RECORD_TYPES, DeadLetter, Record


@dataclass(frozen=True, slots=True)
class Position:
    """Where a record came from; handlers that keep state dedupe re-deliveries by it."""

    partition: int | None = None
    offset: int | None = None


# A handler may return records to produce, as (logical topic, record) pairs.
Emitted = Iterable[tuple[str, Record]] | None
Handler = Callable[[Record, Position], Emitted]
# What a tombstone (a null value under a key, on a compacted topic) means: the record it
# stands for, or None when the key names nothing known (then it is counted and skipped).
Tombstone = Callable[[bytes], Record | None]
INPUT_TOPICS = ("workers", "kv_events", "grants", "outcomes", "graded")
REASON_KIND_LEN = 48


@dataclass(slots=True)
class Consumed:
    record: Record | None
    dead_letter: DeadLetter | None
    emit: list[tuple[str, Record]] = field(default_factory=list)


def reason_kind(reason: str) -> str:
    """A short, low-cardinality label for a dead-letter reason (for metrics)."""
    head = reason.split(":", 1)[0]
    return head[:REASON_KIND_LEN]


@dataclass
class Dispatcher:
    handlers: dict[str, list[Handler]] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)
    dead: Counter[str] = field(default_factory=Counter)
    tombstones: dict[str, Tombstone] = field(default_factory=dict)

    def on_tombstone(self, logical: str, meaning: Tombstone) -> None:
        """Read a null value under a key on ``logical`` as ``meaning(key)`` (``workers``: the
        worker retired) instead of dead-lettering it as an empty record."""
        self.tombstones[logical] = meaning

    def on(self, logical: str, handler: Handler) -> None:
        if logical not in RECORD_TYPES:
            raise KeyError(f"unknown topic {logical!r}")
        self.handlers.setdefault(logical, []).append(handler)

    def consume(
        self,
        logical: str,
        source_topic: str,
        key: bytes | None,
        value: bytes | None,
        partition: int | None = None,
        offset: int | None = None,
    ) -> Consumed:
        meaning = self.tombstones.get(logical) if value is None and key else None
        try:
            record = meaning(key) if meaning is not None and key else None
            if meaning is not None and record is None:
                self.counts[f"{logical}_tombstone_unknown"] += 1
                return Consumed(None, None)
            if record is None:
                record = decode(value, RECORD_TYPES[logical])
        except DecodeError as exc:
            return Consumed(
                None, self._dead(source_topic, exc.reason, key, value, partition, offset)
            )
        position = Position(partition, offset)
        emit: list[tuple[str, Record]] = []
        for handler in self.handlers.get(logical, ()):
            try:
                emit.extend(handler(record, position) or ())
            except Exception as exc:  # a broken handler must not stop the agent
                reason = f"handler error: {type(exc).__name__}: {exc}"
                dead = self._dead(source_topic, reason, key, value, partition, offset)
                return Consumed(record, dead, emit)
        self.counts[logical] += 1
        return Consumed(record, None, emit)

    def _dead(
        self,
        source: str,
        reason: str,
        key: bytes | None,
        value: bytes | None,
        partition: int | None,
        offset: int | None,
    ) -> DeadLetter:
        self.dead[source] += 1
        return DeadLetter(
            source=source,
            reason=reason,
            ts=time.time(),
            partition=partition,
            offset=offset,
            key=key,
            payload=value or b"",
        )
