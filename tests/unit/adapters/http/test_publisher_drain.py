"""The router's publisher: a record that cannot be encoded (a lone surrogate in an id, say)
is dropped and counted, and the records after it are still sent — before, the exception
ended the drain task, and every later grant and outcome stayed in the buffer.

A record counts as published once the broker acknowledged it. A delivery that fails (the
batch expired while the broker was down; after a restart, an idempotent producer that lost
a batch answers OutOfOrderSequenceNumber to every later record of that partition, for good)
puts the record back in the buffer and replaces the producer: before, the delivery futures
were never looked at, every such record was counted as published and lost, and after a
broker restart most grants and outcomes were lost until the router itself restarted."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError, OutOfOrderSequenceNumber

from foretoken.adapters.http.router import publisher as publisher_module
from foretoken.adapters.http.router.publisher import Publisher
from foretoken.settings import load_settings
from foretoken.wire.records import Outcome


class FakeProducer:
    """Sends resolve at once (``fail``: with that exception instead)."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.fail = fail

    async def send(self, topic: str, value: bytes, key: Any,
                   partition: Any) -> asyncio.Future[None]:  # fmt: skip
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.fail is not None:
            future.set_exception(self.fail)
        else:
            self.sent.append((topic, value))
            future.set_result(None)
        return future


def outcome(rid: str) -> Outcome:
    return Outcome(request_id=rid, ts=1.0, kind="first_token", worker_id="w0", actual_ttft_s=0.1)


def test_an_unencodable_record_is_dropped_and_the_rest_are_sent() -> None:
    async def main() -> tuple[Publisher, FakeProducer]:
        pub, producer = Publisher(load_settings(), capacity=16), FakeProducer()
        for rid in ("r1", "bad\udcff", "r2"):
            pub.put("outcomes", outcome(rid))
        task = asyncio.create_task(pub._drain(producer))  # type: ignore[arg-type]
        await asyncio.wait_for(pub.queue.join(), 5.0)
        await asyncio.sleep(0)  # the delivery callbacks
        assert not task.done(), "the drain task ended"
        task.cancel()
        return pub, producer

    pub, producer = asyncio.run(main())
    assert pub.published == 2 and pub.unencodable == 1
    assert [v for _, v in producer.sent if b"bad" in v] == []


def test_a_failed_delivery_is_not_published_and_its_record_waits_in_the_buffer() -> None:
    async def main() -> tuple[Publisher, BaseException | None]:
        pub = Publisher(load_settings(), capacity=16)
        pub.connected = True
        pub.put("outcomes", outcome("r1"))
        producer = FakeProducer(fail=KafkaTimeoutError("batch expired"))
        task = asyncio.create_task(pub._drain(producer))  # type: ignore[arg-type]
        done, _ = await asyncio.wait({task}, timeout=5.0)  # the drain gives the producer up
        return pub, (task.exception() if done else None)

    pub, raised = asyncio.run(main())
    assert raised is not None, "the drain went on with a producer whose delivery failed"
    assert pub.published == 0 and pub.failed_sends == 1 and not pub.connected
    assert pub.queue.qsize() == 1 and pub.queue.get_nowait()[1] == outcome("r1")


def test_a_poisoned_producer_is_replaced_and_every_record_arrives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first producer refuses every record (as one does after a broker restart); the
    publisher replaces it and the next one delivers every record, none counted twice."""
    made: list[FakeProducer] = []

    class Producer(FakeProducer):
        def __init__(self, **_: Any) -> None:
            super().__init__(OutOfOrderSequenceNumber() if not made else None)
            made.append(self)

        async def start(self) -> None:
            pass

        async def stop(self) -> None:
            pass

    async def no_check(self: Publisher) -> None:
        pass

    monkeypatch.setattr(publisher_module, "AIOKafkaProducer", Producer)
    monkeypatch.setattr(publisher_module, "RECONNECT_S", 0.01)
    monkeypatch.setattr(Publisher, "_check_topics", no_check)

    async def main() -> Publisher:
        pub = Publisher(load_settings(), capacity=64)
        for k in range(10):
            pub.put("outcomes", outcome(f"r{k}"))
        await pub.start()
        for _ in range(500):
            if pub.published == 10:
                break
            await asyncio.sleep(0.01)
        await pub.stop(drain_s=0.1)
        return pub

    pub = asyncio.run(main())
    assert len(made) >= 2
    delivered = [v for p in made for _, v in p.sent]
    assert pub.published == 10 == len(delivered), (pub.published, len(delivered))
    assert all(f'"r{k}"'.encode() in b"".join(delivered) for k in range(10))
    assert pub.failed_sends >= 1 and pub.dropped == 0
