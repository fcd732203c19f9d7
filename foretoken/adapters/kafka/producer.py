"""Producing records to foretoken topics (aiokafka, idempotent, batched with linger)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiokafka import AIOKafkaProducer

from foretoken.settings import Settings
from foretoken.wire.codec import encode
from foretoken.wire.records import RECORD_TYPES, Record

LINGER_MS = 5
RESTART_STOP_TIMEOUT_S = 10.0


def record_key(logical: str, record: Record) -> bytes:
    """The partition key of a record: worker id for worker/kv topics, request id otherwise."""
    attr = "worker_id" if logical in ("workers", "kv_events", "controls") else "request_id"
    if logical == "dead_letter":
        attr = "source"
    value = getattr(record, attr)
    return str(value).encode()


class RecordProducer:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._producer = self._new()
        self.restarts = 0

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
        new one runs (what it still held completes or fails through its futures)."""
        old, self._producer = self._producer, self._new()
        await self._producer.start()
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
        )

    async def send_raw(self, logical: str, value: bytes, key: bytes | None = None) -> None:
        """Bytes as they are (tests and the demo use it to show dead-lettering)."""
        await self._producer.send(self.settings.topic(logical), value=value, key=key)

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
