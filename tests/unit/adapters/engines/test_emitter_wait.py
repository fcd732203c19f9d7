"""A record that waits for the Kafka producer shows on ingest's health: with the broker
down, aiokafka holds a send up to its request timeout (~40 s) and the engine's listener with
it, while ``/healthz`` said connected, no failure (an audit's outage); now
``kafka_send_wait_s`` and its gauge say how long."""

from __future__ import annotations

import asyncio
from typing import Any

from foretoken.adapters.engines.emitter import KvEmitter
from foretoken.adapters.engines.health import IngestHealth
from foretoken.settings import load_settings


class _StuckProducer:
    """A producer whose send waits until released (metadata from a broker that is down)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def send_value(self, logical: str, value: bytes, key: bytes) -> Any:
        await self.release.wait()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


def test_a_send_waiting_for_the_producer_shows_on_the_health_page() -> None:
    health = IngestHealth(["w"])

    async def run() -> tuple[float, float, bytes]:
        producer = _StuckProducer()
        emitter = KvEmitter(producer, load_settings(), health.__getitem__)  # type: ignore[arg-type]
        send = asyncio.create_task(emitter.dead_letter("zmq:w", "why", b"", "w"))
        await asyncio.sleep(0.05)
        waiting = health["w"].describe()["kafka_send_wait_s"]
        metrics = health.metrics()
        producer.release.set()
        await send
        return float(waiting), float(health["w"].describe()["kafka_send_wait_s"]), metrics  # type: ignore[arg-type]

    waiting, after, metrics = asyncio.run(run())
    assert waiting >= 0.04 and after == 0.0
    assert b'foretoken_ingest_kafka_send_wait_seconds{worker="w"}' in metrics
