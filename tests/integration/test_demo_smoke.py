"""The newcomer's path in CI (issue 13): `foretoken demo --quick --no-dashboard` from no
broker running — it starts its own, creates fresh topics, starts the worker at once, drives
a slice of the trace and must end with a graded lake and its report."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from foretoken.adapters.lake.views import connect, rows
from tests.conftest import private_broker_config

pytestmark = pytest.mark.integration
DEMO_BUDGET_S = 300.0  # the quick demo takes well under 3 minutes on a quiet machine


def test_quick_demo_from_no_broker_ends_with_a_graded_lake_and_its_report(
    tmp_path: Path,
) -> None:
    broker = private_broker_config(tmp_path)  # nothing answers there yet
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "foretoken.cli", "demo", "--quick", "--no-dashboard",
         "-c", str(broker.config)],
        env=broker.env, cwd=tmp_path, capture_output=True, text=True,
        timeout=DEMO_BUDGET_S + 120, check=False,
    )  # fmt: skip
    took = time.monotonic() - started
    print(out.stdout[-6000:], out.stderr[-3000:])
    assert out.returncode == 0
    assert took < DEMO_BUDGET_S
    lake = tmp_path / "state" / "demo" / "lake"
    con = connect(lake)
    try:
        graded = int(rows(con, "SELECT count(*) AS n FROM graded")[0]["n"])
        served = int(rows(con, "SELECT count(*) AS n FROM graded WHERE status = 'served'")[0]["n"])
    finally:
        con.close()
    assert graded >= 50 and served > 0
    for section in ("within 1 s", "per bound B", "cache disagreement", "per worker"):
        assert section in out.stdout
    assert "…" not in out.stdout  # piped: every header whole
    # The broker it started is stopped again: nothing answers on its port.
    status = broker.cli("kafka", "status")
    assert status.returncode == 1
