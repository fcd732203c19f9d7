"""The router's publisher: a record that cannot be encoded (a lone surrogate in an id, say)
is dropped and counted, and the records after it are still sent — before, the exception
ended the drain task, and every later grant and outcome stayed in the buffer."""

from __future__ import annotations

import asyncio
from typing import Any

from foretoken.adapters.http.router.publisher import Publisher
from foretoken.settings import load_settings
from foretoken.wire.records import Outcome


class FakeProducer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def send(self, topic: str, value: bytes, key: Any, partition: Any) -> None:
        self.sent.append((topic, value))


def outcome(rid: str) -> Outcome:
    return Outcome(request_id=rid, ts=1.0, kind="first_token", worker_id="w0", actual_ttft_s=0.1)


def test_an_unencodable_record_is_dropped_and_the_rest_are_sent() -> None:
    async def main() -> tuple[Publisher, FakeProducer]:
        pub, producer = Publisher(load_settings(), capacity=16), FakeProducer()
        for rid in ("r1", "bad\udcff", "r2"):
            pub.put("outcomes", outcome(rid))
        task = asyncio.create_task(pub._drain(producer))  # type: ignore[arg-type]
        await asyncio.wait_for(pub.queue.join(), 5.0)
        assert not task.done(), "the drain task ended"
        task.cancel()
        return pub, producer

    pub, producer = asyncio.run(main())
    assert pub.published == 2 and pub.unencodable == 1
    assert [v for _, v in producer.sent if b"bad" in v] == []
