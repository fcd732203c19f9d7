"""The worker keeps its learned fits across a restart (streams/app.py save_fits/load_fits)."""

from __future__ import annotations

from pathlib import Path

from foretoken.adapters.kafka.app import WorkerState, fits_path, load_fits, save_fits
from foretoken.core.types import WorkerId
from foretoken.settings import load_settings
from foretoken.wire.records import SchedulerSettings, WorkerEndpoints, WorkerRegistration

A, B = 2e-4, 4e-9


def _state(tmp: Path) -> WorkerState:
    settings = load_settings(env={"FORETOKEN_WORKER_DATA_DIR": str(tmp)})
    state = WorkerState(settings)
    reg = WorkerRegistration(
        worker_id=WorkerId("w0"), model="m", engine="vllm", engine_version="x",
        block_size=16, scheduler=SchedulerSettings(), config_hash="c", ts=0.0,
        endpoints=WorkerEndpoints(http_url="http://w0"),
    )  # fmt: skip
    state.predictor.on_registration(reg)
    return state


def test_fits_survive_a_restart(tmp_path: Path) -> None:
    state = _state(tmp_path)
    for i in range(60):
        n = 500 + 97 * i
        state.predictor.fits.observe_cold(WorkerId("w0"), "c", n, A * n + B * n * n, float(i), 0)
    learned = state.predictor.fits.curve(WorkerId("w0"))
    assert not learned.default
    save_fits(state)
    restarted = _state(tmp_path)
    assert restarted.predictor.fits.curve(WorkerId("w0")).default  # before loading
    assert load_fits(restarted)
    again = restarted.predictor.fits.curve(WorkerId("w0"))
    assert (again.a, again.b, again.samples) == (learned.a, learned.b, learned.samples)


def test_a_bad_fits_file_means_learning_afresh(tmp_path: Path) -> None:
    state = _state(tmp_path)
    assert not load_fits(state)  # none yet
    fits_path(state.settings).write_bytes(b"\x00 not msgpack")
    assert not load_fits(state)
    assert state.predictor.fits.curve(WorkerId("w0")).default


def test_fits_learned_from_other_topics_are_not_lent(tmp_path: Path) -> None:
    state = _state(tmp_path)
    for i in range(60):
        n = 500 + 97 * i
        state.predictor.fits.observe_cold(WorkerId("w0"), "c", n, A * n + B * n * n, float(i), 0)
    save_fits(state)
    settings = load_settings(
        env={"FORETOKEN_WORKER_DATA_DIR": str(tmp_path), "FORETOKEN_TOPIC_PREFIX": "other-"}
    )
    elsewhere = WorkerState(settings)
    assert not load_fits(elsewhere)
