"""Producing records to foretoken topics (aiokafka, idempotent, batched with linger), and
where each goes: by its key (Kafka's default), or by its model when the topics are sharded
(:mod:`foretoken.wire.partitioning`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from typing import Any

import msgspec
from aiokafka import AIOKafkaProducer

from foretoken.settings import Settings
from foretoken.wire.codec import encode
from foretoken.wire.partitioning import SHARDED_TOPICS, model_partition
from foretoken.wire.records import RECORD_TYPES, DeadLetter, Record, WireFormat

log = logging.getLogger(__name__)
LINGER_MS = 5
MAX_REASON_CHARS = 2000
MAX_KEY_BYTES = 1024
# Request id -> model of the grants a producer sent, for their outcomes (which name no
# model); a worker's model is remembered too, for outcomes past this memory.
REQUEST_MODEL_MEMORY = 100_000


class Partitioner:
    """The partition of a record: ``None`` (by key) unless ``sharding = "model"``, then the
    model's. An outcome names no model: it is the model of its grant (the same producer
    sends a request's grant before its outcomes) or of its worker (from the registrations,
    batches and grants this producer has sent, or ``models`` given up front); one that
    matches none goes by key and is counted in ``unplaced``."""

    def __init__(self, settings: Settings, models: dict[str, str] | None = None) -> None:
        self.enabled = settings.sharding == "model"
        self.partitions = settings.layout.partitions
        self.worker_model: dict[str, str] = dict(models or {})
        self.request_model: OrderedDict[str, str] = OrderedDict()
        self.unplaced = 0

    def partition(self, logical: str, record: Record) -> int | None:
        if not self.enabled or logical not in SHARDED_TOPICS:
            return None
        model: str | None = getattr(record, "model", None)
        worker: str = getattr(record, "worker_id", None) or ""
        request: str = getattr(record, "request_id", None) or ""
        if logical == "outcomes":
            model = self.request_model.get(request) or self.worker_model.get(worker)
        elif model is not None:
            if worker:
                self.worker_model[worker] = model
            if logical == "grants":
                self.request_model[request] = model
                if len(self.request_model) > REQUEST_MODEL_MEMORY:
                    self.request_model.popitem(last=False)
        if model is None:
            self.unplaced += 1
            if self.unplaced == 1:
                log.warning("%s record without a known model goes by key (sharding)", logical)
            return None
        return model_partition(model, self.partitions)


RESTART_STOP_TIMEOUT_S = 10.0


def record_key(logical: str, record: Record) -> bytes:
    """The partition key of a record: worker id for worker/kv topics, request id otherwise."""
    attr = "worker_id" if logical in ("workers", "kv_events", "controls") else "request_id"
    if logical == "dead_letter":
        attr = "source"
    elif logical == "members":
        attr = "instance_id"
    value = getattr(record, attr)
    return str(value).encode()


class RecordProducer:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._producer = self._new()
        self.restarts = 0
        self.partitioner = Partitioner(settings)  # by model when the topics are sharded

    def _new(self) -> AIOKafkaProducer:
        return AIOKafkaProducer(
            bootstrap_servers=self.settings.kafka.bootstrap_servers,
            enable_idempotence=True,
            linger_ms=LINGER_MS,
            max_request_size=self.settings.kafka.max_request_bytes,
        )

    async def restart(self) -> None:
        """A new producer (a new producer id) in place of this one. After a record failed, an
        idempotent aiokafka producer refuses every later record of that partition
        (OutOfOrderSequenceNumber); a new one starts clean. The old one is stopped after the
        new one runs (what it still held completes or fails through its futures); a new one
        that cannot start (the broker is down) is stopped and the old one kept, to be
        replaced at the next failure (a failed start used to leave both open)."""
        new = self._new()
        try:
            await new.start()
        except BaseException:
            with contextlib.suppress(Exception):
                await new.stop()
            raise
        old, self._producer = self._producer, new
        self.restarts += 1
        # what went wrong with the records it still held is in their futures
        with contextlib.suppress(Exception):
            await asyncio.wait_for(old.stop(), RESTART_STOP_TIMEOUT_S)

    async def __aenter__(self) -> RecordProducer:
        await self._producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._producer.stop()

    async def send(self, logical: str, record: Record) -> None:
        expected = RECORD_TYPES[logical]
        if not isinstance(record, expected):
            raise TypeError(
                f"topic {logical} takes {expected.__name__}, not {type(record).__name__}"
            )
        await self._producer.send(
            self.settings.topic(logical),
            value=encode(record, self.settings.wire_format),
            key=record_key(logical, record),
            partition=self.partitioner.partition(logical, record),
        )

    async def send_raw(self, logical: str, value: bytes, key: bytes | None = None) -> None:
        """Bytes as they are (tests and the demo use it to show dead-lettering)."""
        await self._producer.send(self.settings.topic(logical), value=value, key=key)

    async def send_tombstone(self, logical: str, key: bytes) -> None:
        """A null value under ``key``: on a compacted topic (``workers``) the key's deletion."""
        await self._producer.send(self.settings.topic(logical), value=None, key=key)

    async def send_value(
        self, logical: str, value: bytes, key: bytes | None
    ) -> asyncio.Future[Any]:
        """Encoded bytes; returns the delivery future (the send itself raises what aiokafka
        refuses at once, e.g. a record over ``kafka.max_request_bytes``)."""
        future: asyncio.Future[Any] = await self._producer.send(
            self.settings.topic(logical), value=value, key=key
        )
        return future

    async def flush(self) -> None:
        await self._producer.flush()


def fitted_dead_letter(letter: DeadLetter, limit: int, wire_format: WireFormat) -> bytes | None:
    """``letter`` encoded within ``limit`` bytes (``kafka.max_request_bytes``): its reason,
    key and as much of its payload as fit (base64 in JSON takes 4/3), the payload's size
    said when cut; None if not even an empty one fits. A dead letter carrying a whole
    oversized record was itself too big to send, and the agent that sent it died."""
    reason = letter.reason[:MAX_REASON_CHARS]
    key = None if letter.key is None else letter.key[:MAX_KEY_BYTES]
    payload = letter.payload
    ratio = 4 / 3 if wire_format == "json" else 1.0
    keep = min(len(payload), int((limit - 4096 - len(reason) * 6 - 2 * len(key or b"")) / ratio))
    while True:
        keep = max(0, keep)
        cut = keep < len(payload)
        fitted = msgspec.structs.replace(
            letter, reason=reason, key=key, payload=payload[:keep],
            payload_size=len(payload) if cut else letter.payload_size,
        )  # fmt: skip
        value = encode(fitted, wire_format)
        if len(value) <= limit:
            return value
        if keep == 0:
            if len(reason) <= 64:
                return None
            reason = reason[:64]
        keep //= 2
