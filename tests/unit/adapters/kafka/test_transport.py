"""The processor's consumer's fetch sizes: the settings reach aiokafka's consumer."""

from __future__ import annotations

import asyncio

import pytest

from foretoken.adapters.kafka.app import create_app
from foretoken.adapters.kafka.transport import BatchedFetchTransport
from foretoken.settings import load_settings


def _fetch_options(env: dict[str, str]) -> tuple[int, int]:
    async def build() -> tuple[int, int]:
        app, _state = create_app(load_settings(env=env))
        assert isinstance(app.transport, BatchedFetchTransport)
        consumer = app.consumer._thread._create_worker_consumer(app.transport)  # type: ignore[attr-defined]
        try:
            return consumer._fetch_min_bytes, consumer._fetch_max_wait_ms
        finally:
            await consumer.stop()  # never started: closes its client

    return asyncio.run(build())


def test_the_consumer_waits_for_a_batch_as_configured() -> None:
    assert _fetch_options({}) == (1, 1500)  # Faust's own
    env = {"FORETOKEN__KAFKA__FETCH_MIN_BYTES": "4096", "FORETOKEN__KAFKA__FETCH_MAX_WAIT_MS": "3"}
    assert _fetch_options(env) == (4096, 3)


def test_fetch_settings_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="fetch_min_bytes"):
        load_settings(env={"FORETOKEN__KAFKA__FETCH_MIN_BYTES": "0"})
