"""The grading dashboard under Streamlit's AppTest: every tab renders, the numbers shown
are the lake's (each expectation computed here from the Parquet files with polars, never
through dashboards/data.py), filters change them, and empty or prediction-less lakes
render with clear notes."""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import polars as pl
import pytest
from streamlit.testing.v1 import AppTest

from foretoken.adapters.dashboard import APP_PATH
from foretoken.adapters.lake.writer import write_lake
from foretoken.wire.records import Graded

APP = APP_PATH
TABS = ["Overview", "Predicted vs actual", "Fits", "Bounds"]
BASE_TS = datetime(2025, 3, 1, tzinfo=UTC).timestamp()
HOURS = 3
BOUNDS = (5.0, 10.0, 30.0)
BLOCK = 16
# worker → (model, true a s/token, true b s/token²)
WORKERS = {
    "a1": ("m-alpha", 3.0e-5, 3.7e-11),
    "a2": ("m-alpha", 6.0e-5, 8.0e-11),
    "b1": ("m-beta", 2.0e-5, 1.0e-11),
    "b2": ("m-beta", 1.2e-4, 2.0e-10),
}
CLASSES = ("chat", "batch")
NO_PREDICTIONS = "No predictions in this lake"


# --------------------------------------------------------------------------- lakes


def synthetic_records(n: int, *, predictions: bool, seed: int = 7) -> list[Graded]:
    """A lake's worth of graded requests with every case the dashboard grades: served with
    accurate and poor predictions, cache disagreement, rejections, explore admissions,
    errors, cold samples, default and fitted curves, several hours, models and classes."""
    rng = np.random.default_rng(seed)
    names = list(WORKERS)
    records = []
    for i in range(n):
        worker = names[i % len(names)]
        model, a, b = WORKERS[worker]
        ts = BASE_TS + HOURS * 3600.0 * i / n
        tokens = int(np.clip(rng.lognormal(9.5, 1.0), 200, 400_000))
        cold = rng.random() < 0.25
        cached = 0 if cold else int(rng.integers(0, tokens // BLOCK)) * BLOCK
        queue = 0.0 if cold else float(rng.exponential(4.0))
        prefill = (tokens - cached) * (a + b * (tokens + cached))
        actual = (queue + prefill) * float(rng.lognormal(0.0, 0.1))
        disagree = rng.random() < 0.06
        engine_cached = max(cached - 4 * BLOCK, 0) if disagree else cached
        predicted = actual * float(rng.lognormal(0.0, 0.9 if disagree else 0.25))
        bound = BOUNDS[int(rng.integers(0, len(BOUNDS)))]
        explore = predictions and predicted > bound and rng.random() < 0.15
        admitted = not predictions or predicted <= bound or explore
        failed = admitted and rng.random() < 0.01
        served = admitted and not failed
        samples = i // len(names)
        fields: dict[str, Any] = dict(
            request_id=f"r{i:05d}", ts=ts, model=model,
            workload_class=CLASSES[int(rng.integers(0, 2))],
            worker_id=worker if admitted else None,
            status="served" if served else "error" if failed else "rejected",
            admitted=admitted, explore=explore, prompt_tokens=tokens,
            credited_cached_tokens=cached if predictions else 0,
            max_queue_wait_s=bound, queue_tokens_ahead=0 if cold else int(queue * 1000),
        )  # fmt: skip
        if served:
            fields |= dict(
                actual_ttft_s=actual, engine_cached_tokens=engine_cached, block_size=BLOCK,
                output_tokens=100, e2e_s=actual + 5.0,
            )  # fmt: skip
        if predictions:
            fields |= dict(
                predicted_ttft_s=predicted, queue_wait_s=min(queue, predicted),
                prefill_s=max(predicted - queue, 0.0),
                fit_a=a * (1 + 0.5 / (1 + samples)), fit_b=b, fit_samples=samples,
                fit_default=samples < 8,
            )  # fmt: skip
            if served:
                fields |= dict(error_s=predicted - actual, cache_disagreement=disagree)
        records.append(Graded(**fields))
    return records


def make_lake(root: Path, n: int = 1200, *, predictions: bool = True) -> Path:
    lake = root / "lake"
    lake.mkdir()
    write_lake(synthetic_records(n, predictions=predictions), lake)
    return lake


def frame(lake: Path) -> pl.DataFrame:
    return pl.read_parquet(str(lake / "graded" / "*" / "part-*.parquet"))


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lake(tmp_path_factory.mktemp("predicted"))


@pytest.fixture(scope="module")
def plain_lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lake(tmp_path_factory.mktemp("plain"), 600, predictions=False)


@pytest.fixture(autouse=True)
def _no_refresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("FORETOKEN_DASHBOARD_REFRESH_S", raising=False)
    yield


def run_app(monkeypatch: pytest.MonkeyPatch, lake: Path | None) -> AppTest:
    if lake is None:
        monkeypatch.delenv("FORETOKEN_LAKE", raising=False)
    else:
        monkeypatch.setenv("FORETOKEN_LAKE", str(lake))
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


# --------------------------------------------------------------------------- expectations


def pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def seconds_shown(value: str) -> float:
    return float(value.removesuffix(" s"))


def expected_grades(df: pl.DataFrame) -> dict[str, Any]:
    served = df.filter(pl.col("status") == "served")
    graded = served.filter(pl.col("error_s").is_not_null())
    err = graded["error_s"].abs()
    known = served.filter(pl.col("cache_disagreement").is_not_null())

    def within_1s(part: pl.DataFrame) -> str:
        return pct(float((part["error_s"].abs() <= 1).mean())) if part.height else "—"  # type: ignore[arg-type]

    under = df.filter(
        pl.col("admitted")
        & (pl.col("predicted_ttft_s") <= pl.col("max_queue_wait_s"))
        & (pl.col("actual_ttft_s") > pl.col("max_queue_wait_s"))
    )
    rejected = df.filter(pl.col("status") == "rejected")
    return {
        "Within 1 s": within_1s(graded),
        "Within 10 s": pct(float((err <= 10).mean())) if graded.height else "—",  # type: ignore[arg-type]
        "Within 1 s · cache agrees": within_1s(graded.filter(~pl.col("cache_disagreement"))),
        "Within 1 s · cache disagrees": within_1s(graded.filter(pl.col("cache_disagreement"))),
        "Cache disagreement": pct(float(known["cache_disagreement"].mean()))  # type: ignore[arg-type]
        if known.height
        else "—",
        "Underpredictions": f"{under.height:,}",
        "Served / rejected": f"{served.height:,} / {rejected.height:,}",
        "abs_error_p95": err.quantile(0.95, interpolation="linear") if graded.height else None,
        "actual_p95": served["actual_ttft_s"].quantile(0.95, interpolation="linear"),
    }


def assert_overview_matches(at: AppTest, df: pl.DataFrame) -> None:
    shown, want = metrics(at), expected_grades(df)
    for label in (
        "Within 1 s", "Within 10 s", "Within 1 s · cache agrees", "Within 1 s · cache disagrees",
        "Cache disagreement", "Underpredictions", "Served / rejected",
    ):  # fmt: skip
        assert shown[label] == want[label], label
    assert seconds_shown(shown["|Error| p95"]) == pytest.approx(want["abs_error_p95"], rel=0.01)
    assert seconds_shown(shown["Actual TTFT p95"]) == pytest.approx(want["actual_p95"], rel=0.01)


def table_with(at: AppTest, *columns: str) -> Any:
    tables = [t.value for t in at.dataframe if set(columns) <= set(t.value.columns)]
    assert len(tables) == 1, f"one table with {columns}"
    return tables[0]


# --------------------------------------------------------------------------- tests


def test_every_tab_renders_with_the_lakes_grades(
    monkeypatch: pytest.MonkeyPatch, lake: Path
) -> None:
    at = run_app(monkeypatch, lake)
    assert [t.label for t in at.tabs] == TABS
    df = frame(lake)
    assert_overview_matches(at, df)
    assert not [i.value for i in at.info if NO_PREDICTIONS in i.value]
    # the lake has every grade's ingredients, so none of them shows as missing
    for label in ("Within 1 s", "Underpredictions", "Est. false alarms · explore"):
        assert metrics(at)[label] != "—", label
    charts = [len(tab.get("vega_lite_chart")) for tab in at.tabs]
    # trend (grades, TTFT, requests); scatter + error histogram; one fit per worker
    assert charts == [3, 2, len(WORKERS), 0]


def test_false_alarm_estimate_from_explore(monkeypatch: pytest.MonkeyPatch, lake: Path) -> None:
    df = frame(lake)
    explored = df.filter(pl.col("explore") & (pl.col("status") == "served"))
    met = explored.filter(pl.col("actual_ttft_s") <= pl.col("max_queue_wait_s")).height
    rejected = df.filter(pl.col("status") == "rejected").height
    assert explored.height and rejected, "the synthetic lake explores and rejects"
    at = run_app(monkeypatch, lake)
    assert (
        metrics(at)["Est. false alarms · explore"] == f"≈ {met / explored.height * rejected:,.0f}"
    )
    assert metrics(at)["Rejected with a bound"] == f"{rejected:,}"


def test_breakdown_by_worker_counts_and_tails(monkeypatch: pytest.MonkeyPatch, lake: Path) -> None:
    at = run_app(monkeypatch, lake)
    shown = table_with(at, "worker", "requests")
    df = frame(lake)
    for worker in WORKERS:
        part = df.filter(pl.col("worker_id") == worker)
        row = shown[shown["worker"] == worker].iloc[0]
        assert row["requests"] == part.height
        served = part.filter(pl.col("status") == "served")
        assert row["actual_p99_s"] == pytest.approx(
            served["actual_ttft_s"].quantile(0.99, interpolation="linear")
        )
    not_routed = shown[shown["worker"] == "(not routed)"].iloc[0]
    assert not_routed["rejected"] == df.filter(pl.col("status") == "rejected").height


@pytest.mark.parametrize(
    ("key", "value", "column"),
    [("worker", "b2", "worker_id"), ("model", "m-alpha", "model"),
     ("workload_class", "batch", "workload_class")],
)  # fmt: skip
def test_sidebar_filters_change_the_numbers(
    monkeypatch: pytest.MonkeyPatch, lake: Path, key: str, value: str, column: str
) -> None:
    at = run_app(monkeypatch, lake)
    before = metrics(at)
    at.multiselect(key=key).set_value([value]).run()
    assert not at.exception
    df = frame(lake).filter(pl.col(column) == value)
    assert_overview_matches(at, df)
    assert metrics(at)["Served / rejected"] != before["Served / rejected"]


def test_time_range_filter(monkeypatch: pytest.MonkeyPatch, lake: Path) -> None:
    at = run_app(monkeypatch, lake)
    slider = at.slider(key="time_range")
    start, _end = slider.value
    end = datetime.fromtimestamp(math.floor(BASE_TS) + 3600, UTC).replace(tzinfo=None)
    slider.set_value((start, end)).run()
    assert not at.exception
    df = frame(lake).filter(pl.col("ts") <= end.replace(tzinfo=UTC).timestamp())
    assert 0 < df.height < frame(lake).height
    assert_overview_matches(at, df)


def test_bound_matrix_counts_the_same_side_of_the_bound(
    monkeypatch: pytest.MonkeyPatch, lake: Path
) -> None:
    at = run_app(monkeypatch, lake)
    at.selectbox(key="bound").set_value(10.0).run()
    assert not at.exception
    df = frame(lake).filter(
        (pl.col("status") == "served")
        & (pl.col("max_queue_wait_s") == 10.0)
        & pl.col("predicted_ttft_s").is_not_null()
    )
    shown = metrics(at)
    for p_within in (True, False):
        for a_within in (True, False):
            n = df.filter(
                ((pl.col("predicted_ttft_s") <= 10.0) == p_within)
                & ((pl.col("actual_ttft_s") <= 10.0) == a_within)
            ).height
            label = f"predicted {'≤' if p_within else '>'} B, actual {'≤' if a_within else '>'} B"
            assert shown[label] == f"{n:,}", label
    both = df.filter((pl.col("predicted_ttft_s") <= 10.0) == (pl.col("actual_ttft_s") <= 10.0))
    assert shown["Same side of the bound"] == pct(both.height / df.height)


def test_what_if_bound_judges_every_served_request(
    monkeypatch: pytest.MonkeyPatch, lake: Path
) -> None:
    at = run_app(monkeypatch, lake)
    at.segmented_control(key="bound_scope").set_value("all served (what-if)").run()
    at.number_input(key="what_if_bound").set_value(2.0).run()
    assert not at.exception
    df = frame(lake).filter(
        (pl.col("status") == "served") & pl.col("predicted_ttft_s").is_not_null()
    )
    n = df.filter((pl.col("predicted_ttft_s") <= 2.0) & (pl.col("actual_ttft_s") > 2.0)).height
    assert metrics(at)["predicted ≤ B, actual > B"] == f"{n:,}"


def test_fits_table_shows_each_workers_latest_fit(
    monkeypatch: pytest.MonkeyPatch, lake: Path
) -> None:
    at = run_app(monkeypatch, lake)
    shown = table_with(at, "a (s per M tokens)")
    latest = (
        frame(lake)
        .filter(pl.col("fit_a").is_not_null() & pl.col("worker_id").is_not_null())
        .sort("ts")
        .group_by("worker_id")
        .agg(pl.col("fit_a").last(), pl.col("fit_samples").last())
    )
    assert sorted(shown["worker"]) == sorted(WORKERS)
    for row in latest.iter_rows(named=True):
        got = shown[shown["worker"] == row["worker_id"]].iloc[0]
        assert got["a (s per M tokens)"] == pytest.approx(row["fit_a"] * 1e6, abs=0.01)
        assert got["samples"] == row["fit_samples"]


def test_lake_without_predictions_says_so_on_every_page(
    monkeypatch: pytest.MonkeyPatch, plain_lake: Path
) -> None:
    at = run_app(monkeypatch, plain_lake)
    assert [t.label for t in at.tabs] == TABS
    notes = [i.value for i in at.info]
    assert sum(NO_PREDICTIONS in n for n in notes) >= 3  # overview, predictions, bounds
    assert any("No fits in this lake" in n for n in notes)
    assert len(at.tabs[1].get("vega_lite_chart")) == 1  # measured TTFT instead of the scatter
    df = frame(plain_lake)
    shown, want = metrics(at), expected_grades(df)
    assert shown["Served / rejected"] == want["Served / rejected"]
    assert seconds_shown(shown["Actual TTFT p95"]) == pytest.approx(want["actual_p95"], rel=0.01)
    assert "Within 1 s" not in shown  # no prediction grades without predictions
    within = df.filter(
        (pl.col("max_queue_wait_s") == 5.0) & (pl.col("actual_ttft_s") <= 5.0)
    ).height
    assert shown["actual ≤ B"] == f"{within:,}"  # the bound page falls back to actuals


def test_empty_lake_renders_every_tab(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    at = run_app(monkeypatch, tmp_path)
    assert [t.label for t in at.tabs] == TABS
    notes = [i.value for i in at.info]
    assert any("no graded requests yet" in n for n in notes)
    assert sum("No graded requests match" in n for n in notes) == len(TABS)
    assert not at.metric


def test_missing_lake_directory_is_shown_as_empty(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    at = run_app(monkeypatch, tmp_path / "not-yet")
    assert any("does not exist" in w.value for w in at.warning)
    assert [t.label for t in at.tabs] == TABS


def test_no_lake_configured_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    at = run_app(monkeypatch, None)
    assert any("No lake" in e.value for e in at.error)
    assert not at.tabs


def test_new_files_show_up_on_the_next_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Live use: the lake grows (from empty) between runs; each run reads what is there."""
    lake = tmp_path / "live"
    at = run_app(monkeypatch, lake)
    assert not at.metric
    records = synthetic_records(400, predictions=True)
    write_lake(records[:200], lake)
    at.run()
    assert metrics(at)["Served / rejected"] == expected_grades(frame(lake))["Served / rejected"]
    write_lake(records[200:], lake)
    at.run()
    assert not at.exception
    assert metrics(at)["Served / rejected"] == expected_grades(frame(lake))["Served / rejected"]


def test_a_redelivered_record_counts_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    records = synthetic_records(300, predictions=True)
    write_lake(records, lake)
    write_lake(records[:100], lake)  # delivered at least once: some requests arrive again
    at = run_app(monkeypatch, lake)
    once = expected_grades(frame(lake).unique("request_id"))
    assert metrics(at)["Served / rejected"] == once["Served / rejected"]
    assert metrics(at)["Within 1 s"] == once["Within 1 s"]


def test_the_lake_reader_keeps_the_latest_row_per_request(tmp_path: Path) -> None:
    from foretoken.adapters.dashboard.data import open_lake

    records = synthetic_records(200, predictions=True)
    write_lake(records, tmp_path)
    write_lake([msgspec.structs.replace(r, prompt_tokens=7) for r in records[:50]], tmp_path)
    want = frame(tmp_path).with_row_index().sort("index").unique("request_id", keep="last")
    con = open_lake(tmp_path)
    got = con.sql("SELECT request_id, prompt_tokens FROM graded ORDER BY request_id").pl()
    assert got.rows() == want.select("request_id", "prompt_tokens").sort("request_id").rows()
    assert got.filter(pl.col("prompt_tokens") == 7).height == 50


def test_refresh_interval_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, lake: Path
) -> None:
    monkeypatch.setenv("FORETOKEN_DASHBOARD_REFRESH_S", "15")
    at = run_app(monkeypatch, lake)
    assert at.number_input(key="refresh_s").value == 15


def test_command_line_lake_wins_over_the_environment() -> None:
    from foretoken.adapters.dashboard.app import app_settings

    env = {"FORETOKEN_LAKE": "/from/env", "FORETOKEN_DASHBOARD_REFRESH_S": "5"}
    assert app_settings(["--lake", "/from/argv"], env).lake == "/from/argv"
    assert app_settings(["-q", "tests/dashboards"], env).lake == "/from/env"
    assert app_settings(["--refresh-s", "2"], env).refresh_s == 2.0
    assert app_settings([], env).refresh_s == 5.0
    assert app_settings([], {}).lake is None


def test_approximate_credit_and_unknown_reuse_are_marked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Engines without KV events (issue 9): their rows count as approximate, their unknown
    reuse stays out of the disagreement, and the breakdown splits by cache source."""
    records = synthetic_records(400, predictions=True)
    silent = {"b1", "b2"}  # m-beta's engines publish no events and report no reuse
    records = [
        msgspec.structs.replace(r, cache_source="approximate", approximate_cache=True,
                                engine_cached_tokens=None, cache_disagreement=None)
        if r.worker_id in silent else r
        for r in records
    ]  # fmt: skip
    lake = tmp_path / "lake"
    write_lake(records, lake)
    df = frame(lake)
    at = run_app(monkeypatch, lake)
    assert_overview_matches(at, df)  # the disagreement is over the known rows only
    served_silent = df.filter((pl.col("status") == "served") & pl.col("worker_id").is_in(silent))
    assert served_silent.height
    card = next(m for m in at.metric if m.label == "Cache disagreement")
    n = f"{served_silent.height:,}"
    assert card.delta is not None and f"{n} approximate, {n} unknown" in card.delta
    at.segmented_control(key="breakdown_by").set_value("cache source").run()
    assert not at.exception
    shown = table_with(at, "cache source", "requests")
    rows = {r["cache source"]: r for _, r in shown.iterrows()}
    assert rows["approximate"]["served"] == served_silent.height
    assert rows["events"]["served"] == df.filter(pl.col("status") == "served").height - (
        served_silent.height
    )
    unknown = rows["approximate"]["disagreement"]
    assert unknown is None or math.isnan(unknown)  # unknown reuse: no rate, never 0


def test_an_unreadable_file_is_one_error_line_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A cut-short or empty part file (a crash before fsync) used to fail the whole page
    with DuckDB's exception and stack trace; the CLI says it in one line, so does the app."""
    lake = tmp_path / "lake"
    write_lake(synthetic_records(50, predictions=True), lake)
    at = run_app(monkeypatch, lake)
    hour = next((lake / "graded").iterdir())
    (hour / "part-99999999999999999999-empty.parquet").write_bytes(b"")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("cannot be read" in e.value and "empty.parquet" in e.value for e in at.error)
