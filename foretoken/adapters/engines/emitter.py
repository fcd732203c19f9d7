"""What ingest writes to Kafka, with every way that can fail handled (never raised).

* A batch becomes one or more ``kv-events`` records below ``ingest.max_record_bytes``
  (:mod:`foretoken.adapters.engines.split`); big batches are encoded off the event loop.
* A record Kafka refuses at once (too big, buffer full past the timeout, producer closed) or
  does not acknowledge later (the delivery future fails) is counted, logged and
  dead-lettered; the worker is marked *lost*, and its next batch is preceded by an
  ``IndexReset`` (the index missed events: its view of the worker is approximate).
* A dead letter carries the reason and at most as much of the payload as fits a record
  (``payload_size`` says how big it was); one still too big is cut further, and a dead letter
  that cannot be produced at all is logged and counted — it never raises.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from foretoken.adapters.engines.health import EngineHealth
from foretoken.adapters.engines.split import Records, encode_records
from foretoken.adapters.kafka.producer import RecordProducer, fitted_dead_letter
from foretoken.settings import Settings
from foretoken.wire.codec import encode
from foretoken.wire.records import DeadLetter, IndexReset, KvEventBatch, Record

log = logging.getLogger(__name__)
# Bytes per encoded event, estimated: decides whether encoding runs off the event loop.
BYTES_PER_HASH, BYTES_PER_TOKEN, BYTES_PER_EVENT = 21, 11, 200
BYTES_PER_PACKED_BYTE = 2  # base64 in JSON: 4/3, rounded up


def estimated_size(batch: KvEventBatch) -> int:
    total = BYTES_PER_EVENT
    for event in batch.events:
        total += BYTES_PER_EVENT + BYTES_PER_HASH * len(getattr(event, "block_hashes", ()))
        total += BYTES_PER_TOKEN * len(getattr(event, "token_ids", ()))
        total += BYTES_PER_PACKED_BYTE * len(getattr(event, "packed_token_ids", b""))
    return total


def dead_letter_value(
    source: str, reason: str, payload: bytes, limit: int, settings: Settings
) -> bytes | None:
    """An encoded dead letter within ``limit`` bytes (:func:`fitted_dead_letter`)."""
    letter = DeadLetter(source=source, reason=reason, ts=time.time(), payload=payload)
    return fitted_dead_letter(letter, limit, settings.wire_format)


class KvEmitter:
    """Produces registrations, batches and dead letters for every engine of one ingest."""

    def __init__(
        self, producer: RecordProducer, settings: Settings, health_of: Callable[[str], EngineHealth]
    ) -> None:
        self.producer = producer
        self.settings = settings
        self.health_of = health_of
        self.limit = settings.ingest.max_record_bytes
        # Workers whose records were lost since their last batch: reset before the next one.
        self.lost: dict[str, str] = {}
        self.dead_letter_failures = 0
        # A record failed: the producer is replaced before the next send (producer.restart).
        self.restart_needed = False
        self._restarting = asyncio.Lock()

    async def register(self, logical: str, record: Record, worker: str) -> bool:
        value = encode(record, self.settings.wire_format)
        return await self._send(logical, value, worker.encode(), worker)

    async def batch(self, batch: KvEventBatch) -> bool:
        """Produce one batch (as one or more records); False when any record was refused."""
        worker = str(batch.worker_id)
        health = self.health_of(worker)
        lost = self.lost.pop(worker, None)
        if lost is not None:
            marker = KvEventBatch(
                worker_id=batch.worker_id, model=batch.model, seq=batch.seq, ts=time.time(),
                events=(IndexReset(reason=f"kv-events records lost: {lost}"[:500]),),
            )  # fmt: skip
            health.resets += 1
            await self._records(marker, health)
        return await self._records(batch, health)

    async def _records(self, batch: KvEventBatch, health: EngineHealth) -> bool:
        worker = str(batch.worker_id)
        records = await self._encode(batch)
        for problem in records.dropped:
            health.dropped_events += 1
            await self.dead_letter(f"zmq:{worker}", f"seq {batch.seq}: {problem}", b"", worker)
        if records.split:
            health.split_batches += 1
        ok = True
        for value in records.values:
            sent = await self._send("kv_events", value, worker.encode(), worker)
            health.records += sent
            ok = ok and sent
        return ok

    async def _encode(self, batch: KvEventBatch) -> Records:
        fmt = self.settings.wire_format
        if estimated_size(batch) > self.settings.ingest.offload_bytes:
            return await asyncio.to_thread(encode_records, batch, self.limit, fmt)
        return encode_records(batch, self.limit, fmt)

    async def dead_letter(self, source: str, reason: str, payload: bytes, worker: str) -> None:
        """Never raises: a dead letter that cannot be made or produced is logged and counted."""
        health = self.health_of(worker)
        value = dead_letter_value(source, reason, payload, self.limit, self.settings)
        if value is None:
            self.dead_letter_failures += 1
            log.error("%s: a dead letter does not fit a record; reason: %.200s", source, reason)
            return
        if await self._send("dead_letter", value, source.encode(), worker, dead=True):
            health.dead_letters += 1

    async def _send(
        self, logical: str, value: bytes, key: bytes, worker: str, dead: bool = False
    ) -> bool:
        health = self.health_of(worker)
        health.send_waiting_since = time.monotonic()  # /healthz: kafka_send_wait_s
        try:
            if self.restart_needed:
                await self._restart()
            future = await self.producer.send_value(logical, value, key)
        except Exception as exc:  # aiokafka refused it at once: never end a listener for it
            self._failed(logical, worker, f"{type(exc).__name__}: {exc}", value, dead)
            return False
        finally:
            health.send_waiting_since = None
        future.add_done_callback(lambda f: self._delivered(f, logical, worker, value, dead))
        return True

    async def _restart(self) -> None:
        async with self._restarting:
            if self.restart_needed:
                self.restart_needed = False
                log.warning("a record failed: replacing the Kafka producer")
                await self.producer.restart()

    def _delivered(
        self, future: asyncio.Future[Any], logical: str, worker: str, value: bytes, dead: bool
    ) -> None:
        if future.cancelled():
            self._failed(logical, worker, "delivery cancelled", value, dead)
        elif (exc := future.exception()) is not None:
            self._failed(logical, worker, f"{type(exc).__name__}: {exc}", value, dead)

    def _failed(self, logical: str, worker: str, why: str, value: bytes, dead: bool) -> None:
        health = self.health_of(worker)
        health.produce_failures += 1
        self.restart_needed = True
        health.last_error = f"{logical}: {why}"[:500]
        log.error("%s: a %s record (%d bytes) was not produced: %s", worker, logical,
                  len(value), why)  # fmt: skip
        if dead:
            self.dead_letter_failures += 1
            return  # a dead letter of a dead letter would fail the same way
        if logical == "kv_events":
            self.lost[worker] = why
        reason = f"{logical} record not produced: {why}"
        task = asyncio.get_running_loop().create_task(
            self.dead_letter(f"ingest:{logical}", reason, value, worker)
        )
        task.add_done_callback(_log_task_error)


def _log_task_error(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("dead letter task failed: %s", task.exception())
