"""The grading dashboard (PRODUCT.md §4): how good were the TTFT predictions?

    foretoken dashboard --lake LAKE_DIR [--refresh-s 10]
    streamlit run foretoken/adapters/dashboard/app.py -- --lake LAKE_DIR [--refresh-s 10]

The lake may also come from ``FORETOKEN_LAKE`` and the refresh interval from
``FORETOKEN_DASHBOARD_REFRESH_S`` (0, the default, turns live refresh off; the sidebar
can change it). Tabs: Overview, Predicted vs actual, Fits, Bounds; sidebar filters by
model, worker, workload class and time. Every query lives in ``dashboards/data.py``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

import duckdb
import polars as pl
import streamlit as st

from foretoken.adapters.dashboard import data
from foretoken.adapters.dashboard.charts import (
    error_histogram,
    fit_chart,
    measured_chart,
    scatter_chart,
    series_chart,
)
from foretoken.adapters.dashboard.controls import controls_section

LAKE_ENV: Final = "FORETOKEN_LAKE"
REFRESH_ENV: Final = "FORETOKEN_DASHBOARD_REFRESH_S"
TABS: Final = ("Overview", "Predicted vs actual", "Fits", "Bounds")
SCATTER_POINTS: Final = 5000
COLD_POINTS_PER_WORKER: Final = 500
FIT_COLUMNS: Final = 3  # fit charts per row
SLIDER_STEPS_S: Final = (1, 10, 60, 300, 900, 3600)
MAX_SLIDER_POSITIONS: Final = 600
NO_PREDICTIONS: Final = (
    "**No predictions in this lake.** The grants carry no predicted TTFT (a routing policy "
    "without a predictor, such as round-robin), so the prediction grades are empty; "
    "measured TTFT and traffic are shown instead."
)
DASH: Final = "—"


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class AppSettings:
    lake: str | None
    refresh_s: float


def app_settings(argv: Sequence[str], env: dict[str, str]) -> AppSettings:
    """``--lake`` / ``--refresh-s`` after ``--`` on the streamlit command line, else the
    environment. Unknown arguments are ignored (under AppTest, argv is pytest's)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--lake")
    parser.add_argument("--refresh-s", type=float)
    args, _unknown = parser.parse_known_args(list(argv))
    refresh = args.refresh_s if args.refresh_s is not None else float(env.get(REFRESH_ENV, 0))
    return AppSettings(lake=args.lake or env.get(LAKE_ENV), refresh_s=max(refresh, 0.0))


@st.cache_resource(show_spinner=False)
def lake_connection(lake: str, has_files: bool) -> duckdb.DuckDBPyConnection:
    """One connection per lake (re-opened once a lake that was empty gets files)."""
    del has_files  # part of the cache key only
    return data.open_lake(lake)


def connect(lake: str) -> duckdb.DuckDBPyConnection:
    return lake_connection(lake, bool(data.lake_files(lake)))


# --------------------------------------------------------------------------- formatting


def pct(x: float | None) -> str:
    return DASH if x is None else f"{x:.1%}"


def count(n: int) -> str:
    return f"{n:,}"


def seconds(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return DASH
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC).replace(tzinfo=None)


PERCENT_COLUMNS: Final = ("within_1s", "within_10s", "disagreement", "served_within")


def table(frame: pl.DataFrame) -> None:
    """A result table: rates as percentages, seconds with two decimals, counts grouped;
    columns with nothing in them (no predictions, say) are left out."""
    if frame.height:
        frame = frame.select(c for c in frame.columns if frame[c].null_count() < frame.height)
    frame = frame.with_columns(pl.col(c) * 100 for c in PERCENT_COLUMNS if c in frame.columns)
    config: dict[str, Any] = {}
    for name, dtype in frame.schema.items():
        label = name.replace("_", " ").removesuffix(" s").replace("abs error", "|err|")
        label = label.replace("actual ", "TTFT ")
        if name in PERCENT_COLUMNS:
            config[name] = st.column_config.NumberColumn(label, format="%.1f%%")
        elif name == "bound_s":
            config[name] = st.column_config.NumberColumn("bound B", format="%g s")
        elif name.endswith("_s"):
            config[name] = st.column_config.NumberColumn(f"{label} (s)", format="%.2f")
        elif dtype.is_integer():
            config[name] = st.column_config.NumberColumn(label, format="localized")
    st.dataframe(frame, hide_index=True, column_config=config, placeholder=DASH)


# --------------------------------------------------------------------------- sidebar


def sidebar(options: data.Options, settings: AppSettings) -> tuple[data.Filters, float]:
    bar = st.sidebar
    bar.header("Filters")
    models = bar.multiselect("Model", options.models, placeholder="All models", key="model")
    workers = bar.multiselect("Worker", options.workers, placeholder="All workers", key="worker")
    classes = bar.multiselect(
        "Workload class", options.classes, placeholder="All classes", key="workload_class"
    )
    start_ts, end_ts = time_range(options)
    bar.divider()
    bar.header("Live")
    refresh = bar.number_input(
        "Auto-refresh every (s), 0 = off", min_value=0, value=math.ceil(settings.refresh_s),
        step=5, key="refresh_s",
        help=f"Re-reads the lake on a timer. Default from --refresh-s or {REFRESH_ENV}.",
    )  # fmt: skip
    bar.caption(f"Lake: `{settings.lake}`")
    filters = data.Filters(tuple(models), tuple(workers), tuple(classes), start_ts, end_ts)
    return filters, float(refresh or 0.0)


def time_range(options: data.Options) -> tuple[float | None, float | None]:
    """A UTC time slider over the lake's span; an end left at the edge stays open (live
    data keeps arriving)."""
    if options.min_ts is None or options.max_ts is None:
        return None, None
    lo, hi = math.floor(options.min_ts), math.ceil(options.max_ts)
    span = hi - lo
    if span < 2:
        return None, None
    step = next((s for s in SLIDER_STEPS_S if span / s <= MAX_SLIDER_POSITIONS), 3600)
    hi = lo + math.ceil(span / step) * step
    chosen = st.sidebar.slider(
        "Time range (UTC)", min_value=utc(lo), max_value=utc(hi), value=(utc(lo), utc(hi)),
        step=timedelta(seconds=step), format="HH:mm:ss" if span < 86400 else "MM-DD HH:mm",
        key="time_range",
    )  # fmt: skip
    st.sidebar.caption(f"{chosen[0]:%Y-%m-%d %H:%M:%S} → {chosen[1]:%Y-%m-%d %H:%M:%S} UTC")
    start, end = (c.replace(tzinfo=UTC).timestamp() for c in chosen)
    return (None if start <= lo else start), (None if end >= hi else end)


# --------------------------------------------------------------------------- overview


def card(
    where: Any, label: str, value: str, explain: str, sub: str | None = None, tone: str = "off"
) -> None:
    """A bordered metric; ``sub`` is a small grey (or, with ``tone``, coloured) line."""
    where.metric(
        label, value, delta=sub, delta_color=tone, delta_arrow="off", help=explain, border=True
    )


def tails_note(q: list[float] | None) -> str | None:
    return None if not q else f"p50 {seconds(q[0])} s · p99 {seconds(q[2])} s"


def p95(q: list[float] | None) -> str:
    return DASH if not q else f"{seconds(q[1])} s"


def overview_tab(
    con: duckdb.DuckDBPyConnection, filters: data.Filters, ov: data.Overview, options: data.Options
) -> None:
    if ov.requests == 0:
        st.info("No graded requests match — nothing to grade yet.")
        return
    fa = data.false_alarms(con, filters)
    served = f"{count(ov.served)} / {count(ov.rejected)}"
    failed = f"{count(ov.failed)} failed of {count(ov.requests)}"
    if ov.predicted == 0:
        st.info(NO_PREDICTIONS)
        row = st.columns(4)
        card(row[0], "Served / rejected", served, "Outcomes of the graded requests.", failed)
        card(row[1], "Actual TTFT p95", p95(ov.actual_q), "Measured TTFT.", tails_note(ov.actual_q))
        known = f"{count(ov.disagreeing)} of {count(ov.cache_known)}" if ov.cache_known else None
        card(row[2], "Cache disagreement", pct(ov.disagreement), DISAGREEMENT_HELP,
             known or "not recorded")  # fmt: skip
        card(row[3], "Rejected with a bound", count(fa.rejected), "Turned away for a bound.",
             f"{pct(fa.rejected / ov.requests)} of requests")  # fmt: skip
    else:
        prediction_cards(ov, fa, served, failed)
    trend_section(con, filters, ov, options)
    st.subheader("Breakdown")
    by = st.segmented_control(
        "Break down by", list(data.BREAKDOWNS), default="worker", key="breakdown_by"
    )
    table(data.breakdown(con, filters, by or "worker"))


DISAGREEMENT_HELP: Final = (
    "Credited and engine-reported cached tokens differ by at least one block, over served "
    "requests where both are known. Engines without KV events are credited approximately "
    "(from the prompts routed there); engines that report no cached tokens leave it unknown."
)


def approximate_note(ov: data.Overview) -> str:
    """The share of the cache grades that rests on approximate or unknown views."""
    parts = [f"{count(ov.approximate_credit)} approximate"] if ov.approximate_credit else []
    parts += [f"{count(ov.reuse_unknown)} unknown"] if ov.reuse_unknown else []
    return f" · {', '.join(parts)}" if parts else ""


def prediction_cards(ov: data.Overview, fa: data.FalseAlarms, served: str, failed: str) -> None:
    row = st.columns(4)
    over = "over served requests with a prediction"
    of = f"of {count(ov.predicted)} predicted"
    card(row[0], "Within 1 s", pct(ov.within_1s), f"|predicted − actual| ≤ 1 s, {over}.", of)
    card(row[1], "Within 10 s", pct(ov.within_10s), f"|predicted − actual| ≤ 10 s, {over}.", of)
    card(
        row[2], "|Error| p95", p95(ov.abs_error_q),
        "Tails of |predicted − actual|: averages are not grades.", tails_note(ov.abs_error_q),
    )  # fmt: skip
    card(
        row[3], "Underpredictions", count(ov.underpredicted),
        "Admitted, predicted ≤ bound B, actual TTFT > B.",
        f"{pct(ov.underprediction_rate)} of {count(ov.promised)} admitted within B",
        "inverse" if ov.underpredicted else "off",
    )  # fmt: skip
    row = st.columns(4)
    card(
        row[0], "Cache disagreement", pct(ov.disagreement), DISAGREEMENT_HELP,
        f"{count(ov.disagreeing)} of {count(ov.cache_known)}" + approximate_note(ov),
    )  # fmt: skip
    same = "|predicted − actual| ≤ 1 s where the credited cache"
    card(row[1], "Within 1 s · cache agrees", pct(ov.within_1s_agreeing), f"{same} agreed.",
         f"of {count(ov.predicted_agreeing)} agreeing")  # fmt: skip
    card(row[2], "Within 1 s · cache disagrees", pct(ov.within_1s_disagreeing),
         f"{same} did not.", f"of {count(ov.predicted_disagreeing)} disagreeing")  # fmt: skip
    card(row[3], "Actual TTFT p95", p95(ov.actual_q), "Measured TTFT.", tails_note(ov.actual_q))
    row = st.columns(4)
    card(row[0], "Served / rejected", served, "Outcomes of the graded requests.", failed)
    card(
        row[1], "Rejected with a bound", count(fa.rejected),
        "Turned away because the predicted TTFT exceeded the client's bound.",
        f"{pct(fa.rejected / ov.requests)} of requests",
    )  # fmt: skip
    false_alarm_cards(row[2:], fa, "")


def approx(x: float | None) -> str:
    return DASH if x is None else f"≈ {x:,.0f}"


def false_alarm_cards(cols: Sequence[Any], fa: data.FalseAlarms, scope: str) -> None:
    card(
        cols[0], f"Est. false alarms{scope} · explore", approx(fa.explore_estimate),
        "Would-be rejections admitted anyway (explore) that met their bound, scaled to the "
        "rejections.", f"{pct(fa.explore_rate)} of {count(fa.explore_served)} explored met B",
    )  # fmt: skip
    card(
        cols[1], f"Est. false alarms{scope} · distribution", approx(fa.distribution_estimate),
        "P(actual ≤ B | predicted) from served requests with a similar prediction "
        f"({data.BINS_PER_DECADE} bins per decade, ≥ {data.MIN_BIN_SUPPORT} samples each).",
        f"{count(fa.covered)} of {count(fa.rejected)} rejections covered",
    )  # fmt: skip


def trend_section(
    con: duckdb.DuckDBPyConnection, filters: data.Filters, ov: data.Overview, options: data.Options
) -> None:
    lo = filters.start_ts if filters.start_ts is not None else options.min_ts or 0.0
    hi = filters.end_ts if filters.end_ts is not None else options.max_ts or 0.0
    width = data.trend_bucket_s(hi - lo)
    label = {3600: "hour", 900: "15 min", 300: "5 min", 60: "minute"}.get(width, f"{width} s")
    st.subheader(f"Trend per {label}")
    frame = data.trend(con, filters, width).with_columns(
        (pl.col("bucket") + pl.duration(seconds=width)).alias("end")
    )
    when = "%H:%M:%S" if hi - lo < 3600 else "%H:%M" if hi - lo < 86400 else "%m-%d %H:%M"
    charts = [
        series_chart(frame, {"actual_p50_s": "p50", "actual_p95_s": "p95"}, "Actual TTFT (s)",
                     when),
        series_chart(frame, {"served": "served", "rejected": "rejected"}, "Requests", when,
                     bars=True),
    ]  # fmt: skip
    if ov.predicted:
        names = {"within_1s": "within 1 s", "within_10s": "within 10 s"}
        charts.insert(0, series_chart(frame, names | {"disagreement": "disagreement"},
                                      "Grades", when, percent=True))  # fmt: skip
    for col, chart in zip(st.columns(len(charts)), charts, strict=True):
        col.altair_chart(chart, width="stretch")


# --------------------------------------------------------------------------- predictions


def predictions_tab(
    con: duckdb.DuckDBPyConnection, filters: data.Filters, ov: data.Overview
) -> None:
    if ov.requests == 0:
        st.info("No graded requests match — nothing to plot yet.")
        return
    if ov.predicted == 0:
        st.info(NO_PREDICTIONS)
        measured = data.scatter(con, filters, SCATTER_POINTS, predicted=False)
        if not measured.is_empty():
            st.altair_chart(measured_chart(measured), width="stretch")
        return
    points = data.scatter(con, filters, SCATTER_POINTS)
    if points.is_empty():
        st.info("No served request has both a positive prediction and a TTFT to plot.")
        return
    shown = f"{count(points.height)} of {count(ov.predicted)}"
    st.caption(
        f"{shown} served requests with a prediction (log axes). ● the cache view agreed with "
        "the engine · ○ hollow: it disagreed by at least one block · ◆ the engine did not say "
        "what it reused. Shaded: within 1 s."
    )
    st.altair_chart(scatter_chart(points), width="stretch")
    st.altair_chart(error_histogram(points), width="stretch")


# --------------------------------------------------------------------------- fits


def fits_tab(con: duckdb.DuckDBPyConnection, filters: data.Filters, ov: data.Overview) -> None:
    if ov.requests == 0:
        st.info("No graded requests match — no fits or cold samples yet.")
        return
    fits = data.fits(con, filters)
    cold = data.cold_samples(con, filters, COLD_POINTS_PER_WORKER)
    st.caption(
        "Each worker's prefill curve C(N) = a·N + b·N² (as used by its latest grant) with "
        "cold requests: served, the engine reported nothing cached, no queue ahead at routing, "
        f"≥ {data.MIN_COLD_PROMPT_TOKENS} prompt tokens — their TTFT is about the prefill."
    )
    if fits.is_empty():
        st.info("**No fits in this lake** (no predictions in this lake): the grants carry no "
                "fitted curve, so only the cold requests are shown.")  # fmt: skip
    else:
        st.dataframe(data.fit_table(fits), hide_index=True)
    workers = sorted(set(fits["worker_id"].to_list()) | set(cold["worker_id"].to_list()))
    if not workers:
        st.caption("No cold requests in the selection.")
    for start in range(0, len(workers), FIT_COLUMNS):
        row = workers[start : start + FIT_COLUMNS]
        for col, worker in zip(st.columns(FIT_COLUMNS), row, strict=False):
            col.altair_chart(fit_chart(worker, fits, cold), width="stretch")


# --------------------------------------------------------------------------- bounds


CELL_MEANING: Final = {  # (predicted ≤ B, actual ≤ B) → what that cell is
    (True, True): "admitted, met B", (True, False): "underprediction",
    (False, True): "false alarm (seen via explore)", (False, False): "late, as predicted",
}  # fmt: skip


def bounds_tab(
    con: duckdb.DuckDBPyConnection, filters: data.Filters, ov: data.Overview, options: data.Options
) -> None:
    if ov.requests == 0:
        st.info("No graded requests match — no bounds to judge yet.")
        return
    summary = data.bound_summary(con, filters)
    if not summary.is_empty():
        st.caption("Per bound B (max_queue_wait_s) the requests carried:")
        table(summary)
    left, right, _ = st.columns([2, 1, 2], vertical_alignment="bottom")
    scope = left.segmented_control(
        "Requests", ["carrying the bound", "all served (what-if)"], key="bound_scope",
        default="carrying the bound" if options.bounds else "all served (what-if)",
    )  # fmt: skip
    what_if = scope == "all served (what-if)"
    if what_if:
        bound = right.number_input(
            "Bound B (s)", min_value=0.1, value=options.bounds[0] if options.bounds else 10.0,
            key="what_if_bound",
        )  # fmt: skip
    elif options.bounds:
        bound = right.selectbox(
            "Bound B (s)", options.bounds, format_func=lambda b: f"{b:g} s", key="bound"
        )
    else:
        st.info("No request in this lake carried a bound; pick a what-if bound instead.")
        return
    matrix = data.bound_matrix(con, filters, float(bound), what_if=what_if)
    st.subheader(f"Same side of B = {float(bound):g} s")
    if matrix.predicted_total == 0:
        if ov.predicted == 0:
            st.info(NO_PREDICTIONS)
        else:
            st.caption("No served request with a prediction for this bound.")
        actual_only(matrix)
    else:
        same_side(matrix)
    if not what_if:
        fa = data.false_alarms(con, filters, float(bound))
        row = st.columns(3)
        at_b = int(summary.filter(pl.col("bound_s") == float(bound))["requests"].sum())
        share = f"{pct(fa.rejected / at_b if at_b else None)} of {count(at_b)} requests at B"
        card(row[0], "Rejected at B", count(fa.rejected), "Rejected with this bound.", share)
        if fa.rejected:  # nothing rejected, no false alarm to estimate
            false_alarm_cards(row[1:], fa, " at B")


def same_side(matrix: data.BoundMatrix) -> None:
    total = matrix.predicted_total
    agree = matrix.cells[(True, True)] + matrix.cells[(False, False)]
    st.metric(
        "Same side of the bound", pct(agree / total),
        help=f"Predicted and actual TTFT on the same side of B, over {count(total)} served "
        "requests with a prediction.",
    )  # fmt: skip
    head = st.columns([1, 2, 2])
    head[1].markdown("**actual ≤ B**")
    head[2].markdown("**actual > B**")
    for predicted in (True, False):
        row = st.columns([1, 2, 2], vertical_alignment="center")
        side = "≤" if predicted else ">"
        row[0].markdown(f"**predicted {side} B**")
        for col, actual in zip(row[1:], (True, False), strict=True):
            n = matrix.cells[(predicted, actual)]
            col.metric(
                f"predicted {side} B, actual {'≤' if actual else '>'} B", count(n),
                delta=f"{n / total:.1%} · {CELL_MEANING[(predicted, actual)]}",
                delta_color="normal" if predicted == actual else "inverse", delta_arrow="off",
                label_visibility="collapsed", border=True,
            )  # fmt: skip
    if matrix.unpredicted_within or matrix.unpredicted_over:
        st.caption("Also served without a prediction:")
        actual_only(matrix)


def actual_only(matrix: data.BoundMatrix) -> None:
    within, over = matrix.unpredicted_within, matrix.unpredicted_over
    total = within + over
    sides = (("actual ≤ B", within), ("actual > B", over))
    for col, (label, n) in zip(st.columns(2), sides, strict=True):
        card(col, label, count(n), f"Served requests with this bound, {label}.",
             pct(n / total if total else None))  # fmt: skip


# --------------------------------------------------------------------------- page


def unreadable(lake: str, exc: duckdb.Error) -> None:
    """A file in the lake DuckDB cannot read (corrupt, cut short, not Parquet): one line
    naming it, as ``foretoken report`` says it, instead of a traceback."""
    st.error(f"The lake at `{lake}` cannot be read: {str(exc).split(chr(10))[0][:500]}")


def body(lake: str, filters: data.Filters) -> None:
    try:
        page(lake, filters)
    except duckdb.Error as exc:  # a file that went bad while the page was open
        unreadable(lake, exc)


def page(lake: str, filters: data.Filters) -> None:
    con = connect(lake)
    options = data.options(con)
    ov = data.overview(con, filters)
    tabs = st.tabs(list(TABS))
    with tabs[0]:
        overview_tab(con, filters, ov, options)
    with tabs[1]:
        predictions_tab(con, filters, ov)
    with tabs[2]:
        fits_tab(con, filters, ov)
    with tabs[3]:
        bounds_tab(con, filters, ov, options)
    controls_section(lake)
    st.caption(f"Read {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC from `{lake}`.")


def main() -> None:
    st.set_page_config(page_title="foretoken · grades", page_icon="⏱", layout="wide")
    settings = app_settings(sys.argv[1:], dict(os.environ))
    st.title("foretoken · prediction grades")
    if not settings.lake:
        st.error(f"No lake: run `foretoken dashboard --lake DIR` or set {LAKE_ENV}.")
        st.stop()
    lake = str(Path(settings.lake).expanduser())
    if not Path(lake).is_dir():
        st.warning(f"The lake directory `{lake}` does not exist (yet); showing it as empty.")
    try:
        options = data.options(connect(lake))
    except duckdb.Error as exc:
        unreadable(lake, exc)
        st.stop()
    if options.min_ts is None:
        st.info(
            f"The lake at `{lake}` has no graded requests yet. Fill it with "
            f"`foretoken replay --limit 3000 --out {lake}` or point the live grading at it."
        )
    filters, refresh = sidebar(options, settings)
    st.fragment(body, run_every=refresh or None)(lake, filters)


if __name__ == "__main__":  # streamlit runs the script as __main__; tests import it
    main()
