"""Benchmark of the grading lake's DuckDB views (sql/, grading/views.py) against polars.

``python -m foretoken.bench.lake_bench [--quick]`` prints one JSON object. It generates a lake of
10 million graded requests (quick: 1 million) over a week of hours with numpy/polars
(vectorized) and writes it through :class:`foretoken.adapters.lake.writer.LakeWriter`, laid out as
a live
lake is: every hour compacted to one file except the last ``LIVE_HOURS``, which hold
several appended files and re-deliveries (a copy of ``REDELIVERED`` of their rows in a
later file). Then it times:

* ``duckdb``: ``SELECT * FROM accuracy_by_hour`` on :func:`foretoken.adapters.lake.views.connect`
  (one
  cold run, then ``REPEATS`` warm ones) — the target is under ``TARGET_S``;
* ``polars``: the baseline, the same aggregation (same dedupe: latest file per request id
  in the multi-file hours) with polars' lazy engine on the same files, in the same run;
  the two results are compared (``results_match``);
* ``compaction``: :meth:`LakeWriter.compact` of the live hours, then the view again;
* ``dedupe_every_row_s``: the cost the single-file shortcut avoids — the per-request-id
  dedupe over every row, as if no hour had ever been compacted (one run).

Wall times depend on what else the machine runs (``machine.load_avg_1m``); the CPU time
of a warm run (``warm_min_cpu_s``, all threads) does not: on an idle machine the wall time
is about that divided by the cores DuckDB uses.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import numpy as np
import polars as pl

from foretoken.adapters.lake.views import connect, query
from foretoken.adapters.lake.writer import (
    HOUR_PARTITION,
    LakeWriter,
    hour_dirs,
    hour_of,
    part_files,
)

FULL_ROWS: Final = 10_000_000
QUICK_ROWS: Final = 1_000_000
HOURS: Final = 168
LIVE_HOURS: Final = 3
LIVE_APPENDS: Final = 4
REDELIVERED: Final = 0.01
REPEATS: Final = 3
TARGET_S: Final = 2.0
START_TS: Final = 1_735_689_600.0  # 2025-01-01T00:00Z
SEED: Final = 7
MODELS: Final = ("kimi-k2", "deepseek-v3", "qwen3-235b")
CLASSES: Final = ("chat", "code", "batch")
WORKERS: Final = 16
STATUSES: Final = ("served", "rejected", "error", "cancelled", "missing_outcome")
STATUS_P: Final = (0.85, 0.13, 0.01, 0.005, 0.005)
BOUNDS: Final = (5.0, 10.0, 30.0, float("nan"))
BLOCK: Final = 16
QUANTILES: Final = (0.5, 0.95, 0.99)
FLOAT_TOLERANCE: Final = 1e-9


# --------------------------------------------------------------------------- data


def _pick(names: tuple[str, ...], codes: np.ndarray) -> pl.Series:
    return pl.Series(list(names), dtype=pl.String).gather(codes)


def generate(rows: int, seed: int = SEED) -> pl.DataFrame:
    """``rows`` graded requests with every ``Graded`` column, vectorized."""
    rng = np.random.default_rng(seed)
    ts = np.sort(START_TS + rng.uniform(0, HOURS * 3600.0, rows))
    status_code = rng.choice(len(STATUSES), rows, p=STATUS_P)
    served, rejected = status_code == 0, status_code == 1
    bound = rng.choice(np.asarray(BOUNDS), rows)
    predicted = np.exp(rng.normal(0.5, 1.2, rows))
    over = np.nan_to_num(bound, nan=60.0) * (1.0 + np.exp(rng.normal(-1.0, 0.5, rows)))
    predicted = np.where(rejected, over, predicted)
    explore = (rng.random(rows) < 0.02) & served
    actual = np.where(served, predicted * np.exp(rng.normal(0.0, 0.4, rows)), np.nan)
    prompt = rng.integers(200, 200_000, rows)
    credited = (prompt * rng.uniform(0, 0.9, rows)).astype(np.int64) // BLOCK * BLOCK
    engine = credited + np.where(rng.random(rows) < 0.04, BLOCK * rng.integers(1, 50, rows), 0)
    worker = rng.integers(0, WORKERS, rows)
    workers = tuple(f"w{i:02d}" for i in range(WORKERS))
    null_unless_served = pl.when(pl.lit(served)).then
    return pl.DataFrame(
        {
            "schema_version": np.ones(rows, dtype=np.int64),
            "request_id": pl.int_range(rows, eager=True).cast(pl.String),
            "ts": ts,
            "model": _pick(MODELS, rng.integers(0, len(MODELS), rows)),
            "workload_class": _pick(CLASSES, rng.integers(0, len(CLASSES), rows)),
            "worker_id": _pick(workers, worker),
            "status": _pick(STATUSES, status_code),
            "admitted": ~rejected,
            "explore": explore,
            "fallback": np.zeros(rows, dtype=bool),
            "prompt_tokens": prompt,
            "predicted_ttft_s": predicted,
            "queue_wait_s": predicted * 0.3,
            "prefill_s": predicted * 0.7,
            "actual_ttft_s": actual,
            "error_s": predicted - actual,
            "credited_cached_tokens": credited,
            "engine_cached_tokens": engine,
            "block_size": np.full(rows, BLOCK, dtype=np.int64),
            "cache_disagreement": np.abs(engine - credited) >= BLOCK,
            "max_queue_wait_s": bound,
            "already_waited_s": np.zeros(rows),
            "retry_after_s": np.where(rejected, 1.0, np.nan),
            "output_tokens": rng.integers(1, 2000, rows),
            "e2e_s": np.nan_to_num(actual) + rng.uniform(1, 60, rows),
            "fit_a": np.full(rows, 3e-5),
            "fit_b": np.full(rows, 3.7e-11),
            "fit_samples": np.full(rows, 500, dtype=np.int64),
            "fit_default": np.zeros(rows, dtype=bool),
            "queue_tokens_ahead": rng.integers(0, 500_000, rows),
            "approximate_cache": np.zeros(rows, dtype=bool),
        },
        nan_to_null=True,
    ).with_columns(
        pl.when(pl.col("status") == "rejected").then(None).otherwise(pl.col("worker_id"))
        .alias("worker_id"),
        null_unless_served(pl.col("cache_disagreement")).alias("cache_disagreement"),
    )  # fmt: skip


def write(root: Path, frame: pl.DataFrame, seed: int = SEED) -> dict[str, Any]:
    """The live-lake layout: compacted hours, then the last hours in several appends with
    re-deliveries. Returns what was written."""
    rng = np.random.default_rng(seed)
    writer = LakeWriter(root, durable=False)
    hours = frame.select(hour_of(pl.col("ts"))).to_series()
    live = sorted(hours.unique().to_list())[-LIVE_HOURS:]
    is_live = hours.is_in(live)
    writer.append_frame(frame.filter(~is_live))
    recent = frame.filter(is_live)
    batch = rng.integers(0, LIVE_APPENDS, recent.height)
    for index in range(LIVE_APPENDS):
        writer.append_frame(recent.filter(pl.Series(batch == index)))
    again = recent.sample(fraction=REDELIVERED, seed=seed)
    writer.append_frame(again)
    return {"live_hours": live, "redelivered_rows": again.height}


# --------------------------------------------------------------------------- baseline


def polars_accuracy_by_hour(root: Path) -> pl.DataFrame:
    """``accuracy_by_hour`` in polars: the same dedupe and the same aggregates."""
    files = {hour: part_files(directory) for hour, directory in hour_dirs(root).items()}
    multi = [hour for hour, paths in files.items() if len(paths) > 1]
    scan = pl.scan_parquet(
        [path for paths in files.values() for path in paths],
        hive_partitioning=True,
        hive_schema={HOUR_PARTITION: pl.String},
        include_file_paths="filename",
    )
    in_multi = pl.col(HOUR_PARTITION).is_in(multi)
    latest = pl.concat(
        [
            scan.filter(~in_multi),
            scan.filter(in_multi).sort("filename").unique("request_id", keep="last"),
        ]
    )
    abs_error = pl.col("error_s").abs()
    bound = pl.col("max_queue_wait_s")
    waited = pl.col("already_waited_s").fill_null(0.0)
    predicted_within = waited + pl.col("predicted_ttft_s") <= bound
    # a request that failed or was given up with no first token past the bound: not within
    censored = (pl.col("admitted") & pl.col("status").is_in(["error", "cancelled"])
                & (waited + pl.col("e2e_s") > bound))  # fmt: skip
    actual_within = (pl.when(pl.col("actual_ttft_s").is_not_null())
                     .then(pl.col("actual_ttft_s") <= bound)
                     .when(censored).then(False).otherwise(None))  # fmt: skip
    promised = pl.col("admitted") & pl.col("explore").fill_null(False).not_()  # no explore
    under = promised & predicted_within & actual_within.not_()
    return (
        latest.group_by(HOUR_PARTITION)
        .agg(
            pl.len().alias("requests"),
            (pl.col("status") == "served").sum().alias("served"),
            (pl.col("status") == "rejected").sum().alias("rejected"),
            abs_error.count().alias("graded"),
            (abs_error <= 1).mean().alias("within_1s"),
            (abs_error <= 10).mean().alias("within_10s"),
            *[
                abs_error.quantile(q, interpolation="linear").alias(f"abs_error_p{q * 100:g}_s")
                for q in QUANTILES
            ],
            (predicted_within == actual_within).count().alias("bounded"),
            (predicted_within == actual_within).sum().alias("same_side"),
            under.sum().alias("underpredictions"),
        )
        .sort(HOUR_PARTITION)
        .collect()
    )


def _same(duck: pl.DataFrame, polar: pl.DataFrame) -> bool:
    if duck.columns != polar.columns or duck.height != polar.height:
        return False
    for name in duck.columns:
        left, right = duck[name], polar[name]
        if left.dtype.is_float():
            diff = (left - right.cast(pl.Float64)).abs().max()
            if diff is not None and float(diff) > FLOAT_TOLERANCE:  # type: ignore[arg-type]
                return False
        elif left.cast(pl.String).to_list() != right.cast(pl.String).to_list():
            return False
    return True


# --------------------------------------------------------------------------- timing


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[dict[str, float], Any]:
    """One cold run, then ``repeats`` warm ones: wall times, and the least CPU time the
    process spent on a warm run (all threads: what the query costs on an idle machine,
    however busy this one is)."""
    started = time.perf_counter()
    result = fn()
    cold = time.perf_counter() - started
    warm, cpu = [], []
    for _ in range(repeats):
        started, cpu_started = time.perf_counter(), time.process_time()
        result = fn()
        warm.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    stats = {
        "cold_s": round(cold, 3),
        "warm_min_s": round(min(warm), 3),
        "warm_median_s": round(statistics.median(warm), 3),
        "warm_min_cpu_s": round(min(cpu), 3),
    }
    return stats, result


def _lake_stats(root: Path) -> dict[str, Any]:
    files = [p for d in hour_dirs(root).values() for p in part_files(d)]
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}


def run(quick: bool) -> dict[str, Any]:
    rows = QUICK_ROWS if quick else FULL_ROWS
    root = Path(tempfile.mkdtemp(prefix="lake-bench-"))
    try:
        started = time.perf_counter()
        frame = generate(rows)
        generate_s = time.perf_counter() - started
        started = time.perf_counter()
        layout = write(root, frame)
        write_s = time.perf_counter() - started
        del frame
        lake = {"rows": rows, **layout, **_lake_stats(root), "hours": HOURS}
        con = connect(root)
        sql = "SELECT * FROM accuracy_by_hour"
        duck, duck_result = _timed(lambda: query(con, sql), REPEATS)
        polar, polar_result = _timed(lambda: polars_accuracy_by_hour(root), REPEATS)
        started = time.perf_counter()
        compacted = LakeWriter(root).compact()
        compact_s = time.perf_counter() - started
        after, after_result = _timed(lambda: query(con, sql), REPEATS)
        started = time.perf_counter()
        query(con, EVERY_ROW_DEDUPE)
        every_row_s = time.perf_counter() - started
        return {
            "lake": lake,
            "generate_s": round(generate_s, 3),
            "write_s": round(write_s, 3),
            "target_s": TARGET_S,
            "duckdb": duck,
            "polars": polar,
            "polars_over_duckdb": round(polar["warm_min_s"] / duck["warm_min_s"], 2),
            "meets_target": duck["warm_median_s"] < TARGET_S,
            "results_match": _same(duck_result, polar_result),
            "requests_after_dedupe": int(duck_result["requests"].sum()),
            "compaction": {
                "hours": len(compacted),
                "files_merged": sum(c.merged_files for c in compacted),
                "duplicates_removed": sum(c.rows_in - c.rows_out for c in compacted),
                "compact_s": round(compact_s, 3),
                "files_after": _lake_stats(root)["files"],
                "duckdb_after": after,
                "numbers_unchanged": _same(duck_result, after_result),
            },
            "dedupe_every_row_s": round(every_row_s, 3),
            "machine": {
                "cpus": os.cpu_count(),
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "python": platform.python_version(),
            },
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


# What accuracy_by_hour would cost if no hour were ever compacted: dedupe every row.
EVERY_ROW_DEDUPE: Final = """
SELECT hour, count(*) AS requests, count(error_s) AS graded,
       avg((abs(error_s) <= 1)::INTEGER) AS within_1s,
       quantile_cont(abs(error_s), [0.5, 0.95, 0.99]) AS abs_error_q
FROM (
    SELECT * FROM graded_raw
    QUALIFY row_number() OVER (PARTITION BY request_id ORDER BY filename DESC) = 1
)
GROUP BY hour
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1M rows instead of 10M")
    print(json.dumps(run(parser.parse_args().quick), indent=2))


if __name__ == "__main__":
    main()
