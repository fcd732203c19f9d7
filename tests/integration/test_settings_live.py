"""Every kind of setting reaches the running processor (issue 14): one predictor, one fit,
one join and one controls setting, given by file and by environment, read back from what
the running parts use (``/v1/config`` reads the objects, not the settings)."""

from __future__ import annotations

from pathlib import Path

import pytest

from foretoken.adapters.processes import get_json, stop
from foretoken.settings import Settings
from tests.conftest import launch_worker

pytestmark = pytest.mark.integration


def test_file_and_environment_settings_reach_the_running_processor(
    kafka_settings: Settings, tmp_path: Path
) -> None:
    config = tmp_path / "foretoken.toml"
    config.write_text(
        "[predictor]\nexplore_fraction = 0.07\n[fits.prefill]\nwindow = 96\n"
        "[join]\ntimeout_s = 240.0\n[controls]\nwindow_s = 45.0\n"
    )
    proc, worker = launch_worker(
        kafka_settings, tmp_path, FORETOKEN_CONFIG=str(config),
        FORETOKEN__PREDICTOR__OVERLOAD_WAIT_S="77", FORETOKEN__FITS__DEFAULT_A="3e-4",
        FORETOKEN__JOIN__EXPIRY_INTERVAL_S="2.5", FORETOKEN__CONTROLS__MIN_SAMPLES="7",
    )  # fmt: skip
    try:
        running = get_json(f"{worker.url}/v1/config")
    finally:
        stop(proc)
    assert running["predictor"]["explore_fraction"] == 0.07  # file
    assert running["predictor"]["overload_wait_s"] == 77.0  # environment
    assert running["fits"]["prefill"]["window"] == 96
    assert running["fits"]["default_a"] == 3e-4
    assert running["join"]["timeout_s"] == 240.0 and running["join"]["expiry_interval_s"] == 2.5
    assert running["controls"]["window_s"] == 45.0 and running["controls"]["min_samples"] == 7
