"""Faust's aiokafka transport, with the processor's consumer's fetch sizes configurable.

Faust builds its consumer with ``fetch_max_wait_ms=1500`` and aiokafka's default
``fetch_min_bytes=1``: the broker answers a fetch as soon as one record is there, so a
processor following ``grants`` and ``outcomes`` at a few hundred records a second sends a
fetch (every assigned partition, encoded in Python) for every few records — ~40% of a busy
route replica's CPU (py-spy, the replicas bench). ``kafka.fetch_min_bytes`` and
``kafka.fetch_max_wait_ms`` batch them (docs/BENCHMARKS.md: 64 KiB / 10 ms), at the cost of
an idle consumer polling every ``fetch_max_wait_ms``; the defaults are Faust's.
"""

from __future__ import annotations

from typing import Any, ClassVar

from faust.transport.drivers import aiokafka as driver

FAUST_FETCH: tuple[int, int] = (1, 1500)  # (min bytes, max wait ms) Faust itself asks for


class _ConsumerThread(driver.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        fetch: tuple[int, int] = getattr(self.app, "fetch_options", FAUST_FETCH)
        # aiokafka keeps its constructor's options in these two fields until start(), which
        # hands them to its Fetcher; Faust passes no way to set them. Checked, not assumed:
        for name in ("_fetch_min_bytes", "_fetch_max_wait_ms"):
            if not hasattr(consumer, name):
                raise RuntimeError(f"aiokafka's consumer has no {name}: update transport.py")
        consumer._fetch_min_bytes, consumer._fetch_max_wait_ms = fetch
        return consumer


class _Consumer(driver.Consumer):
    def _new_consumer_thread(self) -> driver.AIOKafkaConsumerThread:
        return _ConsumerThread(self, loop=self.loop, beacon=self.beacon)


class BatchedFetchTransport(driver.Transport):
    """:class:`faust.transport.drivers.aiokafka.Transport` with :class:`_Consumer`."""

    Consumer: ClassVar[Any] = _Consumer
