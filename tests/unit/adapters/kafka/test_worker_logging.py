"""The worker logs at its configured level: no library's debug records are built."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import faust
import pytest

from foretoken.adapters.kafka.app import faust_worker


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        yield root
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def _fetcher_debug_enabled(worker: faust.Worker) -> bool:
    worker._setup_logging()  # what execute_from_commandline does first
    return logging.getLogger("aiokafka.consumer.fetcher").isEnabledFor(logging.DEBUG)


def test_the_worker_keeps_the_configured_level(root_logger: logging.Logger) -> None:
    app = faust.App("ft-logging-test", broker="kafka://127.0.0.1:1")
    assert not _fetcher_debug_enabled(faust_worker(app, "warn"))
    assert root_logger.level == logging.WARNING
    # Faust's own worker (its spinner) would have let every debug record be built
    assert _fetcher_debug_enabled(faust.Worker(app, loglevel="warn"))
