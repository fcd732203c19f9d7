"""A real ZMQ publisher emitting vLLM-format batches — with a repaired gap, an unrepairable
gap and an engine restart — through `foretoken ingest`, the real broker and the Faust
worker's cache index; `/v1/cache` shows what the events imply."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from foretoken.adapters.processes import foretoken_cmd, get_json, spawn, stop
from tests.conftest import RunningWorker
from tests.integration.zmq_engine import BLOCK, FakeEngine, cached, prompt, wait_until
from tests.integration.zmq_engine import lookup as hits_of

pytestmark = pytest.mark.integration
MODEL = "ingest-model"
WORKER = "zmq-w0"


def lookup(worker: RunningWorker, tokens: list[int]) -> int:
    return cached(worker, MODEL, WORKER, tokens)


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    eng = FakeEngine(WORKER)
    yield eng
    eng.close()


def test_gap_replay_reset_and_restart_reach_the_index(
    engine: FakeEngine, faust_worker: RunningWorker, tmp_path: Path
) -> None:
    engines = tmp_path / "engines.toml"
    engines.write_text(engine.engines_toml(MODEL))
    ingest_cmd = foretoken_cmd("ingest", "--engines", str(engines), "--port", "0")
    ingest = spawn(ingest_cmd, faust_worker.env, tmp_path / "ingest.log")
    try:
        page = f"{faust_worker.url}/v1/cache/{MODEL}"
        wait_until(lambda: WORKER in get_json(page)["workers"], "the registration")
        time.sleep(1.0)  # the SUB connection settles; earlier batches would be replayed anyway
        engine.stored(0, prompt(0))
        engine.stored(1, prompt(1))
        wait_until(lambda: lookup(faust_worker, prompt(1)) == 4 * BLOCK, "seq 0-1")
        # seq 2 is never published but stays in the replay buffer: the gap is repaired.
        engine.stored(2, prompt(2), publish=False)
        engine.stored(3, prompt(3))
        wait_until(lambda: lookup(faust_worker, prompt(3)) == 4 * BLOCK, "seq 3")
        assert lookup(faust_worker, prompt(2)) == 4 * BLOCK  # came through replay
        assert get_json(page)["workers"][WORKER]["resets"] == 0
        # seq 4 is lost for good: ingest resets the worker's index, then applies seq 5.
        engine.stored(4, prompt(4), publish=False, buffer=False)
        engine.stored(5, prompt(5))
        wait_until(lambda: lookup(faust_worker, prompt(5)) == 4 * BLOCK, "seq 5")
        assert lookup(faust_worker, prompt(0)) == 0  # forgotten by the reset
        assert get_json(page)["workers"][WORKER]["resets"] == 1
        # The engine restarts: seq 0 again, with an empty cache.
        engine.buffer.clear()
        engine.stored(0, prompt(6), base_hash=77_000_000)
        wait_until(lambda: lookup(faust_worker, prompt(6)) == 4 * BLOCK, "the restart")
        state = get_json(page)["workers"][WORKER]
        assert state["resets"] == 2
        assert lookup(faust_worker, prompt(5)) == 0
        assert state["blocks"]["GPU"] == 4
        # A new process starts empty and its stream is complete from seq 0: exact again.
        assert state["approximate"] is False
        assert hits_of(faust_worker, MODEL, prompt(6))[WORKER]["approximate"] is False
    finally:
        stop(ingest)
