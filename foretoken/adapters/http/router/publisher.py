"""Grants and outcomes to Kafka without a Kafka round trip on the request path.

Records go into a bounded in-memory queue (``put`` never waits); a background task drains it
through an idempotent, batching aiokafka producer. While Kafka is down the queue absorbs up to
``capacity`` records; past that new records are dropped and counted, and the router keeps
serving. A record counts as published once the broker acknowledged it: one whose delivery
fails (expired while the broker was down, or refused) is put back in the queue (dropped and
counted if it is full) and the producer is replaced — an idempotent producer that lost a
batch refuses every later record of that partition (OutOfOrderSequenceNumber) for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from functools import partial

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from foretoken.adapters.kafka.producer import LINGER_MS, Partitioner, record_key
from foretoken.adapters.kafka.readiness import StartupError, wait_for_topics
from foretoken.settings import Settings
from foretoken.wire.codec import encode
from foretoken.wire.records import Record

log = logging.getLogger(__name__)
RECONNECT_S = 1.0
PUBLISHED_TOPICS = ("grants", "outcomes")


class Publisher:
    def __init__(self, settings: Settings, capacity: int) -> None:
        self.settings = settings
        self.queue: asyncio.Queue[tuple[str, Record]] = asyncio.Queue(maxsize=capacity)
        self.dropped = 0
        self.published = 0
        self.failed_sends = 0  # sends or deliveries that failed (their records re-queued)
        # Records that could not be encoded (a bug upstream): dropped one by one, counted.
        self.unencodable = 0
        self.connected = False
        # Topics this router writes that the broker does not have (checked on connect).
        self.missing_topics: list[str] = []
        self._task: asyncio.Task[None] | None = None
        # By model when the topics are sharded (an outcome goes where its grant went).
        self.partitioner = Partitioner(settings)
        # Records handed to the producer and not yet acknowledged (delivery future → record).
        self._inflight: dict[asyncio.Future[object], tuple[str, Record]] = {}
        self._generation = 0  # the producer's; a failed delivery of the current one breaks it
        self._broken: KafkaError | None = None
        self._alarm: asyncio.Future[None] | None = None

    def put(self, logical: str, record: Record) -> bool:
        try:
            self.queue.put_nowait((logical, record))
            return True
        except asyncio.QueueFull:
            self.dropped += 1
            return False

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self, drain_s: float = 5.0) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.queue.join(), drain_s)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            producer = AIOKafkaProducer(
                bootstrap_servers=self.settings.kafka.bootstrap_servers,
                enable_idempotence=True,
                linger_ms=LINGER_MS,
            )
            self._generation += 1
            self._broken = None
            try:
                await producer.start()
                self.connected = True
                await self._check_topics()
                await self._drain(producer)
            except KafkaError as exc:
                log.warning("kafka unavailable (%s); buffering %d records", exc, self.queue.qsize())
            except Exception:  # never let the drain task die: every later record would be lost
                log.exception("the publisher failed; reconnecting")
            finally:
                self.connected = False
                with contextlib.suppress(Exception):
                    await producer.stop()  # what it held is delivered or fails (re-queued)
                self._requeue_unresolved()
            await asyncio.sleep(RECONNECT_S)

    def _requeue_unresolved(self) -> None:
        """Records a stopped producer neither delivered nor failed: back in the queue."""
        for future, (logical, record) in list(self._inflight.items()):
            if not future.done():
                del self._inflight[future]
                self.failed_sends += 1
                self.put(logical, record)

    def _delivered(self, generation: int, future: asyncio.Future[object]) -> None:
        held = self._inflight.pop(future, None)
        if held is None:
            return  # already re-queued
        logical, record = held
        exc = None if future.cancelled() else future.exception()
        if not future.cancelled() and exc is None:
            self.published += 1
            return
        self.failed_sends += 1
        self.put(logical, record)  # again (dropped and counted when the buffer is full)
        if generation == self._generation and self._broken is None:
            self.connected = False
            self._broken = KafkaError(f"a {logical} record was not delivered: {exc!r}")
            if self._alarm is not None and not self._alarm.done():
                self._alarm.set_result(None)

    async def _next(self) -> tuple[str, Record]:
        """The next record to send; raises as soon as a delivery of this producer failed."""
        if self._broken is not None:
            raise self._broken
        if not self.queue.empty():
            return self.queue.get_nowait()
        getter = asyncio.ensure_future(self.queue.get())
        self._alarm = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait((getter, self._alarm), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._alarm = None
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            if self._broken is None:
                return getter.result()
            self.queue.task_done()  # this producer is given up: the record waits for the next
            self.put(*getter.result())
        assert self._broken is not None
        raise self._broken

    async def _check_topics(self) -> None:
        """Say clearly, once per connection, when a topic this router writes is missing
        (records wait in the buffer meanwhile; ``/healthz`` lists them)."""
        try:
            await wait_for_topics(self.settings, PUBLISHED_TOPICS, service="the router",
                                  timeout_s=0.0)  # fmt: skip
            self.missing_topics = []
        except StartupError as exc:
            self.missing_topics = exc.topics
            log.error("%s (grants and outcomes wait in the buffer)", exc)

    async def _drain(self, producer: AIOKafkaProducer) -> None:
        fmt = self.settings.wire_format
        while True:
            logical, record = await self._next()
            try:
                value, key = encode(record, fmt), record_key(logical, record)
                partition = self.partitioner.partition(logical, record)
            except Exception as exc:  # a record that cannot be written: lose it, not the rest
                self.unencodable += 1
                self.queue.task_done()
                log.error("dropped a %s record that cannot be encoded (%s: %s)", logical,
                          type(exc).__name__, exc)  # fmt: skip
                continue
            try:
                future = await producer.send(self.settings.topic(logical), value=value, key=key,
                                             partition=partition)  # fmt: skip
            except KafkaError:
                self.failed_sends += 1
                self.queue.task_done()
                # Put it back at the front is impossible with asyncio.Queue; re-queue it.
                self.put(logical, record)
                raise
            self._inflight[future] = (logical, record)
            future.add_done_callback(partial(self._delivered, self._generation))
            self.queue.task_done()
