"""The grading report and the SQL shell (grading/report.py) on the golden lake of
test_grading_sql.py (its numbers are worked out there)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from rich.console import Console

from foretoken.adapters.lake.report import render, report, sql_shell
from tests.unit.adapters.lake.test_views import Z, build_golden


@pytest.fixture()
def lake(tmp_path: Path) -> Path:
    build_golden(tmp_path)
    return tmp_path


def test_report_is_json_and_carries_the_grades(lake: Path) -> None:
    summary = report(lake, draws=50)
    assert json.loads(json.dumps(summary)) == summary
    assert summary["files"] == 3
    assert summary["totals"]["requests"] == 10 and summary["totals"]["served"] == 7
    acc = summary["accuracy"]
    assert acc["within_1s"] == pytest.approx(2 / 7) and acc["within_10s"] == pytest.approx(5 / 7)
    assert acc["abs_error_p50_s"] == pytest.approx(3.0)
    assert summary["underpredictions"]["underpredictions"] == 1
    bounds = {row["bound_s"]: row for row in summary["bounds"]}
    five = bounds[5.0]
    assert five["underpredictions"] == 0 and five["predicted_over_actual_within"] == 1
    assert five["false_alarms"]["direct"]["estimated_false_alarms_lo"] == pytest.approx(
        1 / (1 + Z * Z)
    )
    # Seven served requests are too few to fit the conditional quantiles: counted, no estimate.
    model = five["false_alarms"]["model_based"]
    assert model["rejected"] == 1 and model["estimated_false_alarms"] is None
    assert summary["cache_disagreement"]["within_1s_agreeing"] == pytest.approx(0.25)
    assert [row["model"] for row in summary["by_model"]] == ["m1", "m2"]
    assert len(summary["by_worker"]) == 6 and len(summary["by_class"]) == 2
    assert [row["hour"] for row in summary["by_hour"]] == ["2025-01-01T00", "2025-01-01T01"]


def test_render_prints_every_section(lake: Path) -> None:
    console = Console(record=True, width=220)
    render(report(lake, draws=50), console)
    text = console.export_text()
    for expected in ("within 1 s", "28.6%", "per bound B", "cache disagreement", "per model",
                     "per worker", "per workload class", "per hour", "2025-01-01T01"):  # fmt: skip
        assert expected in text


HEADERS = ("false alarms: explore [95%]", "false alarms: model [95%]", "pred>B act≤B",
           "≤1 s disagreeing", "reuse unknown", "p99 |err|", "same side")  # fmt: skip


def test_piped_report_prints_every_column_header_whole(lake: Path) -> None:
    """``foretoken report --lake L | cat``: not a terminal, so no 80-column squeeze."""
    out = subprocess.run(
        [sys.executable, "-m", "foretoken.cli", "report", "--lake", str(lake)],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    assert "…" not in out
    for header in HEADERS:
        assert header in out, header
    assert "\x1b[" not in out  # plain text, no colour codes


def test_narrow_console_squeezes_headers_which_is_why_piped_output_is_wide(lake: Path) -> None:
    console = Console(record=True, width=80)
    console.print(_bounds(lake))
    assert "…" in console.export_text()  # what `| cat` printed before


def _bounds(lake: Path) -> object:
    from foretoken.adapters.lake.report import _bounds_table

    return _bounds_table(report(lake, draws=50))


@pytest.fixture()
def console() -> Iterator[Console]:
    yield Console(record=True, width=200)


def test_sql_shell_runs_one_query(lake: Path, console: Console) -> None:
    status = sql_shell(lake, "SELECT model, requests FROM by_model", console=console)
    text = console.export_text()
    assert status == 0 and "m1" in text and "2 rows" in text
    assert sql_shell(lake, "SELECT nope FROM graded", console=console) == 1
    assert "Error" in console.export_text()


def test_sql_shell_repl_until_quit(lake: Path, console: Console) -> None:
    lines = iter([".views", "SELECT count(*) AS n FROM graded;", "", "garbage", ".quit", "x"])
    status = sql_shell(lake, console=console, read_line=lambda _prompt: next(lines))
    text = console.export_text()
    assert status == 0 and "accuracy_by_hour" in text and "10" in text and "Error" in text
    assert next(lines) == "x"  # stopped reading at .quit

    def eof(_prompt: str) -> str:
        raise EOFError

    assert sql_shell(lake, console=console, read_line=eof) == 0


def test_p90_coverage_counts_served_requests_whose_grant_carried_one(tmp_path: Path) -> None:
    from foretoken.adapters.lake.writer import LakeWriter
    from tests.unit.adapters.lake.test_views import served

    rows = [served(f"p{i}", "w1", 2.0, actual, 5.0, 0, 0) for i, actual in
            enumerate((1.0, 2.5, 3.9, 4.1, 9.0))]  # fmt: skip
    rows = [msgspec.structs.replace(r, predicted_ttft_p90_s=4.0) for r in rows]
    rows.append(served("none", "w1", 2.0, 50.0, 5.0, 0, 0))  # no p90: not counted
    LakeWriter(tmp_path).append(rows)
    acc = report(tmp_path, draws=10)["accuracy"]
    assert acc["graded_p90"] == 5 and acc["p90_coverage"] == pytest.approx(3 / 5)


def test_an_older_lake_without_p90_reports_no_coverage(lake: Path) -> None:
    acc = report(lake, draws=10)["accuracy"]
    assert acc["graded_p90"] == 0 and acc["p90_coverage"] is None
