"""Reading the ``graded`` topic from its start (the demo and tests)."""

from __future__ import annotations

import time
import uuid

from aiokafka import AIOKafkaConsumer

from foretoken.core.grading.summary import summarize
from foretoken.settings import Settings
from foretoken.wire.codec import DecodeError, decode
from foretoken.wire.records import Graded

IDLE_S = 5.0

__all__ = ["read_graded", "summarize"]


async def read_graded(settings: Settings, timeout_s: float, idle_s: float = IDLE_S) -> list[Graded]:
    """Every graded record, one per request id (the latest), until the topic has been quiet
    for ``idle_s`` or ``timeout_s`` passed."""
    consumer = AIOKafkaConsumer(
        settings.topic("graded"), bootstrap_servers=settings.kafka.bootstrap_servers,
        auto_offset_reset="earliest", group_id=f"reader-{uuid.uuid4().hex[:8]}",
        enable_auto_commit=False,
    )  # fmt: skip
    await consumer.start()
    out: dict[str, Graded] = {}
    try:
        deadline = time.monotonic() + timeout_s
        last = time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - last < idle_s:
            for msgs in (await consumer.getmany(timeout_ms=500)).values():
                for m in msgs:
                    try:
                        g = decode(m.value, Graded)
                    except DecodeError:
                        continue
                    out[g.request_id] = g
                    last = time.monotonic()
    finally:
        await consumer.stop()
    return list(out.values())
