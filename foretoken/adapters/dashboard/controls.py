"""The latency controls' state changes on the dashboard (issue #8).

Reads the :class:`~foretoken.wire.records.ControlEvent` records kept beside the lake under
``LAKE/controls/*.parquet`` (``foretoken replay --controls on --out LAKE`` writes them, see
``fleet/classes.py``) and shows, when there are any, a step chart of each (class, worker)'s
stage over time and the table of changes with their reasons (objective, tail, remaining
budget, signals). Nothing is shown for a lake without control events.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import altair as alt
import polars as pl
import streamlit as st

CONTROLS_DIR: Final = "controls"  # foretoken.sim.classes.CONTROLS_DIR (no fleet import here)
STAGE_LEVEL: Final = {"ok": 0, "warn": 1, "reroute": 2, "admission": 3}
TABLE_COLUMNS: Final = (
    "time",
    "workload_class",
    "worker_id",
    "from_stage",
    "to_stage",
    "reason",
    "objective_ttft_s",
    "tail_queue_s",
    "remaining_budget_s",
    "signal_peak_queue_tokens",
    "signal_arrival_rps",
    "signal_service_rps",
    "signal_timeouts",
    "signal_cancellations",
)


def control_events(lake: str | Path) -> pl.DataFrame:
    """Every control event of the lake, oldest first (empty frame when there are none)."""
    files = sorted((Path(lake) / CONTROLS_DIR).glob("*.parquet"))
    if not files:
        return pl.DataFrame()
    frame = pl.concat([pl.read_parquet(f) for f in files], how="diagonal_relaxed")
    return frame.sort("ts").with_columns(
        pl.from_epoch(pl.col("ts"), time_unit="s").alias("time"),
        pl.col("to_stage").replace_strict(STAGE_LEVEL, return_dtype=pl.Int64).alias("level"),
        (pl.col("workload_class") + " @ " + pl.col("worker_id")).alias("track"),
    )


def stage_chart(events: pl.DataFrame) -> alt.Chart:
    return (
        alt.Chart(events.select("time", "track", "level", "to_stage", "reason").to_pandas())
        .mark_line(interpolate="step-after", point=True)
        .encode(
            x=alt.X("time:T", title="time (UTC)"),
            y=alt.Y(
                "level:Q",
                title="stage",
                scale=alt.Scale(domain=[0, 3]),
                axis=alt.Axis(
                    values=[0, 1, 2, 3],
                    labelExpr=("['ok','warn','reroute','admission'][datum.value]"),
                ),
            ),
            color=alt.Color("track:N", title="class @ worker"),
            tooltip=["time:T", "track:N", "to_stage:N", "reason:N"],
        )
        .properties(height=260)
    )


def controls_section(lake: str | Path) -> None:
    events = control_events(lake)
    if not events.height:
        return
    st.subheader("Latency controls")
    now = events.group_by("track").agg(pl.col("to_stage").last().alias("stage"))
    counts = {s: int((now["stage"] == s).sum()) for s in STAGE_LEVEL}
    cols = st.columns(len(STAGE_LEVEL) + 1)
    cols[0].metric("State changes", f"{events.height:,}")
    for col, (stage, n) in zip(cols[1:], counts.items(), strict=True):
        col.metric(f"Tracks now at {stage}", f"{n:,}")
    st.altair_chart(stage_chart(events), use_container_width=True)
    shown = events.select(c for c in TABLE_COLUMNS if c in events.columns)
    st.dataframe(shown.reverse(), hide_index=True)
