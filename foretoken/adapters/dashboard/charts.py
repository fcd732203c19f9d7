"""The dashboard's charts (Altair), built from the query results of :mod:`.data`; no
Streamlit here, so each chart can be built and checked on its own."""

from __future__ import annotations

from typing import Any, Final

import altair as alt
import numpy as np
import polars as pl

LOG_TICKS: Final = tuple(m * 10.0**e for e in range(-3, 7) for m in (1, 3))
ERROR_CLIP_S: Final = 10.0
Layered = alt.LayerChart | alt.FacetChart  # what layering (and .properties) gives back


def series_chart(
    frame: pl.DataFrame, names: dict[str, str], title: str, when: str, *, percent: bool = False,
    bars: bool = False,
) -> alt.Chart:  # fmt: skip
    """One line (or stacked bar) per column of ``frame`` named in ``names``, over buckets."""
    long = frame.unpivot(
        index=["bucket", "end"], on=list(names), variable_name="series"
    ).with_columns(pl.col("series").replace(names))
    chart = alt.Chart(long, title=title)
    if bars:  # each bar spans its bucket
        chart = chart.mark_bar(opacity=0.9, orient="vertical").encode(x2="end:T")
    else:
        chart = chart.mark_line(point=alt.OverlayMarkDef(size=18))
    return chart.encode(
        alt.X("bucket:T", title=None, axis=alt.Axis(format=when, labelAngle=0)),
        alt.Y("value:Q", title=None, stack=True if bars else None,
              scale=alt.Scale(domain=[0, 1]) if percent else alt.Undefined,
              axis=alt.Axis(format="%" if percent else "~s", labelFlush=False)),
        alt.Color("series:N", title=None, sort=list(names.values()),
                  legend=alt.Legend(orient="bottom", labelLimit=0)),
        tooltip=["bucket:T", "series:N",
                 alt.Tooltip("value:Q", format=".1%" if percent else ",.2f")],
    ).properties(height=260)  # fmt: skip


def scatter_chart(points: pl.DataFrame) -> Layered:
    values = points.select("predicted_ttft_s", "actual_ttft_s").to_numpy()
    lo, hi = max(float(values.min()), 1e-3), float(values.max())
    grid = np.geomspace(lo, hi, 80)
    band = pl.DataFrame({"x": grid, "low": np.maximum(grid - 1.0, lo), "high": grid + 1.0})
    log = alt.Scale(type="log", domain=[lo, hi], nice=False)
    axis = alt.Axis(values=[t for t in LOG_TICKS if lo <= t <= hi], format="~g")

    def xy(x: str, y: str) -> list[Any]:  # every layer the same scales and titles
        return [alt.X(x, scale=log, axis=axis, title="Predicted TTFT (s)"),
                alt.Y(y, scale=log, axis=axis, title="Actual TTFT (s)")]  # fmt: skip

    shade = alt.Chart(band).mark_area(opacity=0.15, color="#54a24b")
    shade = shade.encode(*xy("x:Q", "low:Q"), alt.Y2("high:Q"))
    diagonal = alt.Chart(band).mark_line(color="#888", strokeDash=[4, 4]).encode(*xy("x:Q", "x:Q"))
    base = alt.Chart(points).encode(
        *xy("predicted_ttft_s:Q", "actual_ttft_s:Q"),
        alt.Color("worker_id:N", title="Worker", scale=alt.Scale(scheme="tableau10")),
        tooltip=[
            "request_id:N", "worker_id:N", "workload_class:N", "prompt_tokens:Q",
            alt.Tooltip("predicted_ttft_s:Q", format=".2f"),
            alt.Tooltip("actual_ttft_s:Q", format=".2f"),
            "credited_cached_tokens:Q", "engine_cached_tokens:Q", "cache_source:N",
        ],
    )  # fmt: skip
    agree = base.transform_filter("datum.cache_view == 'agrees'").mark_point(
        filled=True, size=22, opacity=0.55
    )
    unknown = base.transform_filter("datum.cache_view == 'unknown'").mark_point(
        shape="diamond", filled=True, size=30, opacity=0.55
    )
    disagree = base.transform_filter("datum.cache_disagreement").mark_point(
        filled=False, size=70, strokeWidth=1.6, opacity=0.9
    )
    layers = shade + diagonal + agree + unknown + disagree
    return layers.properties(height=520).interactive()


def measured_chart(points: pl.DataFrame) -> alt.Chart:
    """Without predictions: measured TTFT against prompt size (log axes)."""

    def log_axis(column: str, fmt: str) -> dict[str, Any]:
        lo, hi = float(points[column].min()), float(points[column].max())  # type: ignore[arg-type]
        ticks = [t for t in LOG_TICKS if lo <= t <= hi]
        scale = alt.Scale(type="log", domain=[lo, hi], nice=False)
        return {"scale": scale, "axis": alt.Axis(values=ticks, format=fmt)}

    return alt.Chart(points, title="Measured TTFT by prompt size").mark_circle(
        size=22, opacity=0.6
    ).encode(
        alt.X("prompt_tokens:Q", title="prompt tokens", **log_axis("prompt_tokens", "~s")),
        alt.Y("actual_ttft_s:Q", title="Actual TTFT (s)", **log_axis("actual_ttft_s", "~g")),
        alt.Color("worker_id:N", title="Worker", scale=alt.Scale(scheme="tableau10")),
        tooltip=["request_id:N", "worker_id:N", "prompt_tokens:Q", "engine_cached_tokens:Q",
                 alt.Tooltip("actual_ttft_s:Q", format=".2f")],
    ).properties(height=460)  # fmt: skip


def error_histogram(points: pl.DataFrame) -> alt.LayerChart:
    errors = points.with_columns(
        pl.col("cache_view").alias("cache"),
        pl.col("error_s").clip(-ERROR_CLIP_S, ERROR_CLIP_S).alias("clipped"),
    )  # fmt: skip
    bars = (
        alt.Chart(errors, title=f"Error: predicted − actual (s), clipped to ±{ERROR_CLIP_S:g} s")
        .mark_bar(opacity=0.85)
        .encode(
            alt.X("clipped:Q", bin=alt.Bin(step=0.25),
                  axis=alt.Axis(values=np.linspace(-ERROR_CLIP_S, ERROR_CLIP_S, 11).tolist(),
                                format="~g"),
                  title="seconds (negative: later than predicted)"),
            alt.Y("count():Q", title="requests", stack=True),
            alt.Color("cache:N", title="cache view",
                      scale=alt.Scale(domain=["agrees", "disagrees", "unknown"],
                                      range=["#4c78a8", "#f58518", "#bab0ac"])),
        )
    )  # fmt: skip
    marks = pl.DataFrame({"x": [-1.0, 1.0]})
    rules = alt.Chart(marks).mark_rule(color="#54a24b", strokeDash=[4, 4]).encode(x="x:Q")
    return (bars + rules).properties(height=260)


def fit_chart(worker: str, fits: pl.DataFrame, cold: pl.DataFrame) -> Layered:
    samples = cold.filter(pl.col("worker_id") == worker)
    fit = fits.filter(pl.col("worker_id") == worker)
    top = float(samples["prompt_tokens"].to_numpy().max()) if samples.height else 100_000.0
    layers = [
        alt.Chart(samples).mark_circle(size=28, opacity=0.6, color="#4c78a8").encode(
            alt.X("prompt_tokens:Q", title="prompt tokens", axis=alt.Axis(format="~s")),
            alt.Y("actual_ttft_s:Q", title="TTFT (s)"),
            tooltip=["prompt_tokens:Q", alt.Tooltip("actual_ttft_s:Q", format=".3f")],
        )
    ]  # fmt: skip
    curve_note = "no fit"
    if not fit.is_empty():
        a, b = float(fit["fit_a"][0]), float(fit["fit_b"][0])
        n = np.linspace(0.0, top * 1.05, 60)
        curve = pl.DataFrame({"prompt_tokens": n, "actual_ttft_s": a * n + b * n * n})
        samples_used = fit["fit_samples"][0]
        curve_note = (
            f"{'default curve' if fit['fit_default'][0] else 'fit'} ({samples_used} samples)"
        )
        line = alt.Chart(curve).mark_line(color="#e45756", strokeWidth=2)
        layers.append(line.encode(alt.X("prompt_tokens:Q"), alt.Y("actual_ttft_s:Q")))
    subtitle = f"{curve_note} · {samples.height} cold requests"
    title = alt.TitleParams(worker, subtitle=subtitle, anchor="start")
    return alt.layer(*layers).properties(height=240, title=title)
