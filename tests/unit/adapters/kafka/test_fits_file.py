"""The processor keeps its learned fits across a restart (adapters/kafka/fits_file.py)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from foretoken.adapters.kafka.fits_file import fits_path, load_fits, save_fits
from foretoken.adapters.kafka.processor import ProcessorState
from foretoken.core.routing.outputs import OutputLengths
from foretoken.core.types import ModelName, RequestId, WorkerId
from foretoken.settings import load_settings
from foretoken.wire.records import SchedulerSettings, WorkerEndpoints, WorkerRegistration

A, B = 2e-4, 4e-9


def _state(tmp: Path) -> ProcessorState:
    settings = load_settings(env={"FORETOKEN_WORKER_DATA_DIR": str(tmp)})
    state = ProcessorState(settings)
    reg = WorkerRegistration(
        worker_id=WorkerId("w0"), model="m", engine="vllm", engine_version="x",
        block_size=16, scheduler=SchedulerSettings(), config_hash="c", ts=0.0,
        endpoints=WorkerEndpoints(http_url="http://w0"),
    )  # fmt: skip
    state.core.register(reg)
    return state


def test_fits_survive_a_restart(tmp_path: Path) -> None:
    state = _state(tmp_path)
    for i in range(60):
        n = 500 + 97 * i
        state.fits.observe_cold(WorkerId("w0"), "c", n, A * n + B * n * n, float(i), 0)
    learned = state.fits.curve(WorkerId("w0"))
    assert not learned.default
    save_fits(state.settings, state.fits)
    restarted = _state(tmp_path)
    assert restarted.fits.curve(WorkerId("w0")).default  # before loading
    assert load_fits(restarted.settings, restarted.fits)
    again = restarted.fits.curve(WorkerId("w0"))
    assert (again.a, again.b, again.samples) == (learned.a, learned.b, learned.samples)


def test_a_bad_fits_file_means_learning_afresh(tmp_path: Path) -> None:
    state = _state(tmp_path)
    assert not load_fits(state.settings, state.fits)  # none yet
    fits_path(state.settings).write_bytes(b"\x00 not msgpack")
    assert not load_fits(state.settings, state.fits)
    assert state.fits.curve(WorkerId("w0")).default


def test_fits_learned_from_other_topics_are_not_lent(tmp_path: Path) -> None:
    state = _state(tmp_path)
    for i in range(60):
        n = 500 + 97 * i
        state.fits.observe_cold(WorkerId("w0"), "c", n, A * n + B * n * n, float(i), 0)
    save_fits(state.settings, state.fits)
    settings = load_settings(
        env={"FORETOKEN_WORKER_DATA_DIR": str(tmp_path), "FORETOKEN_TOPIC_PREFIX": "other-"}
    )
    elsewhere = ProcessorState(settings)
    assert not load_fits(elsewhere.settings, elsewhere.fits)


def test_learned_answer_lengths_survive_a_restart(tmp_path: Path) -> None:
    state = _state(tmp_path)
    outputs = state.outputs
    for i in range(40):
        rid = RequestId(f"r{i}")
        outputs.sent(rid, ModelName("m"), 4100 if i % 2 else None)
        outputs.completed(rid, 300 + i)
    learned = (outputs.expected(ModelName("m"), 4100), outputs.expected(ModelName("m"), None))
    assert learned[0] < 4100 and learned[1] != outputs.default_output_tokens
    save_fits(state.settings, state.fits, outputs)
    restarted = _state(tmp_path)
    assert restarted.outputs.expected(ModelName("m"), 4100) == 4100  # before loading
    assert load_fits(restarted.settings, restarted.fits, restarted.outputs)
    again = restarted.outputs
    assert (again.expected(ModelName("m"), 4100), again.expected(ModelName("m"), None)) == learned
    # a file without them (an older processor's) loads the fits, the lengths learned afresh
    save_fits(state.settings, state.fits)
    fresh = _state(tmp_path)
    assert load_fits(fresh.settings, fresh.fits, fresh.outputs)
    assert fresh.outputs.expected(ModelName("m"), 4100) == 4100


def test_a_malformed_lengths_snapshot_is_refused() -> None:
    outputs = OutputLengths(default_output_tokens=128, memory=8)
    for bad in (b"\x00", msgspec.msgpack.encode([["m", "nope", 3, 1.0]]),
                msgspec.msgpack.encode([["m", "share", 3, float("nan")]])):  # fmt: skip
        with pytest.raises(ValueError, match="output lengths snapshot"):
            outputs.load_state(bad)
