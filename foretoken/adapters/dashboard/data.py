"""The grading dashboard's queries (PRODUCT.md §4), as plain functions over a DuckDB
connection on a grading lake (``LAKE/graded/hour=…/part-*.parquet``).

The connection comes from :func:`open_lake`: the project's SQL views
(:func:`foretoken.adapters.lake.views.connect`, one row per request id, the latest written);
a lake with no files yet gets an empty, typed ``graded`` table instead. Every query reads
only ``graded`` and takes its filters as ``?`` parameters — the SQL text is fixed, never
built from user input. Each query runs on its own cursor, so one connection serves every
Streamlit session (each runs in its own thread).

No Streamlit here: the app (``app.py`` beside it) decides how things look.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import duckdb
import polars as pl

from foretoken.adapters.lake.views import connect
from foretoken.adapters.lake.writer import LAKE_TABLE, PART_GLOB
from foretoken.core.cost.fit import MIN_COLD_PROMPT_TOKENS

PARQUET_GLOB: Final = f"*/{PART_GLOB}"  # under LAKE/graded
READ_ATTEMPTS: Final = 3  # a compaction may delete a listed file mid-query: run it again
BINS_PER_DECADE: Final = 4  # predicted-TTFT bins for the distribution-based false alarms
MIN_BIN_SUPPORT: Final = 20  # served requests a bin needs before it estimates anything
TREND_WIDTHS_S: Final = (3600, 900, 300, 60, 10, 5, 1)  # hour first; finer for short lakes
MIN_TREND_BUCKETS: Final = 8
QUANTILES: Final = (0.5, 0.95, 0.99)
TOKENS_PER_M: Final = 1e6


# --------------------------------------------------------------------------- connection


def lake_files(lake_dir: str | Path) -> list[Path]:
    return sorted((Path(lake_dir) / LAKE_TABLE).glob(PARQUET_GLOB))


def open_lake(lake_dir: str | Path) -> duckdb.DuckDBPyConnection:
    """A connection whose ``graded`` view holds the lake's records (the grading views of
    :mod:`foretoken.adapters.lake.views`: one row per request id, the latest written; empty,
    with every column and grade typed, when the lake has no files yet)."""
    return connect(lake_dir)


# --------------------------------------------------------------------------- filters


@dataclass(frozen=True, slots=True)
class Filters:
    """Sidebar filters; an empty tuple means "all", a None time means "open-ended"."""

    models: tuple[str, ...] = ()
    workers: tuple[str, ...] = ()
    classes: tuple[str, ...] = ()
    start_ts: float | None = None
    end_ts: float | None = None

    def params(self) -> list[Any]:
        """The parameters of :data:`FILTERED`, in order."""
        return [
            -math.inf if self.start_ts is None else self.start_ts,
            math.inf if self.end_ts is None else self.end_ts,
            *([list(self.models)] * 2),
            *([list(self.workers)] * 2),
            *([list(self.classes)] * 2),
        ]


# The filtered lake as CTE ``g``; every query starts with it and appends its own
# parameters after Filters.params().
FILTERED: Final = """
WITH g AS (
    SELECT * FROM graded
    WHERE ts >= ?::DOUBLE AND ts <= ?::DOUBLE
      AND (len(?::VARCHAR[]) = 0 OR list_contains(?::VARCHAR[], model))
      AND (len(?::VARCHAR[]) = 0 OR list_contains(?::VARCHAR[], worker_id))
      AND (len(?::VARCHAR[]) = 0 OR list_contains(?::VARCHAR[], workload_class))
)
"""


def _frame(con: duckdb.DuckDBPyConnection, sql: str, params: list[Any]) -> pl.DataFrame:
    for attempt in range(READ_ATTEMPTS):
        try:
            with con.cursor() as cur:
                return cur.sql(sql, params=params).pl()
        except duckdb.IOException:
            if attempt == READ_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _row(con: duckdb.DuckDBPyConnection, sql: str, params: list[Any]) -> dict[str, Any]:
    rows = _frame(con, sql, params).to_dicts()
    return rows[0] if rows else {}


@dataclass(frozen=True, slots=True)
class Options:
    """What the filters can choose from (the whole lake)."""

    models: list[str]
    workers: list[str]
    classes: list[str]
    min_ts: float | None
    max_ts: float | None
    bounds: list[float]


def options(con: duckdb.DuckDBPyConnection) -> Options:
    def distinct(column: str) -> list[str]:
        sql = f"SELECT DISTINCT {column} AS v FROM graded WHERE {column} IS NOT NULL ORDER BY v"
        return [str(v) for v in _frame(con, sql, [])["v"].to_list()]

    span = _row(con, "SELECT min(ts) AS lo, max(ts) AS hi FROM graded", [])
    bounds = _frame(
        con,
        "SELECT DISTINCT max_queue_wait_s AS v FROM graded"
        " WHERE max_queue_wait_s IS NOT NULL ORDER BY v",
        [],
    )["v"].to_list()
    return Options(
        models=distinct("model"),
        workers=distinct("worker_id"),
        classes=distinct("workload_class"),
        min_ts=span.get("lo"),
        max_ts=span.get("hi"),
        bounds=[float(b) for b in bounds],
    )


# --------------------------------------------------------------------------- overview

GRADED_SERVED: Final = "status = 'served' AND error_s IS NOT NULL"


@dataclass(frozen=True, slots=True)
class Overview:
    """The headline grades of the filtered requests (PRODUCT.md §4). Rates are None when
    nothing qualifies (for example, no predictions in the lake)."""

    requests: int
    served: int
    rejected: int
    failed: int  # error, cancelled, missing_outcome
    predicted: int  # served with a prediction (what the within-N grades are over)
    within_1s: float | None
    within_10s: float | None
    abs_error_q: list[float] | None  # |error_s| at QUANTILES
    actual_q: list[float] | None  # actual TTFT of served requests at QUANTILES
    cache_known: int
    disagreeing: int
    predicted_agreeing: int  # predicted (as above) and the cache view agreed
    predicted_disagreeing: int
    within_1s_agreeing: float | None
    within_1s_disagreeing: float | None
    promised: int  # admitted and predicted within their bound (served, so graded)
    underpredicted: int  # … and the actual TTFT exceeded it
    approximate_credit: int = 0  # served on engines without KV events (approximate view)
    reuse_unknown: int = 0  # served where the engine did not say what it reused

    @property
    def disagreement(self) -> float | None:
        return self.disagreeing / self.cache_known if self.cache_known else None

    @property
    def underprediction_rate(self) -> float | None:
        return self.underpredicted / self.promised if self.promised else None


def overview(con: duckdb.DuckDBPyConnection, filters: Filters) -> Overview:
    sql = (
        FILTERED
        + f"""
SELECT
    count(*) AS requests,
    count(*) FILTER (status = 'served') AS served,
    count(*) FILTER (status = 'rejected') AS rejected,
    count(*) FILTER (status IN ('error', 'cancelled', 'missing_outcome')) AS failed,
    count(*) FILTER ({GRADED_SERVED}) AS predicted,
    avg((abs(error_s) <= 1)::INT) FILTER ({GRADED_SERVED}) AS within_1s,
    avg((abs(error_s) <= 10)::INT) FILTER ({GRADED_SERVED}) AS within_10s,
    quantile_cont(abs(error_s), ?::DOUBLE[]) FILTER ({GRADED_SERVED}) AS abs_error_q,
    quantile_cont(actual_ttft_s, ?::DOUBLE[]) FILTER (status = 'served') AS actual_q,
    count(*) FILTER (status = 'served' AND cache_disagreement IS NOT NULL) AS cache_known,
    count(*) FILTER (status = 'served' AND cache_disagreement) AS disagreeing,
    count(*) FILTER ({GRADED_SERVED} AND NOT cache_disagreement) AS predicted_agreeing,
    count(*) FILTER ({GRADED_SERVED} AND cache_disagreement) AS predicted_disagreeing,
    avg((abs(error_s) <= 1)::INT)
        FILTER ({GRADED_SERVED} AND NOT cache_disagreement) AS within_1s_agreeing,
    avg((abs(error_s) <= 1)::INT)
        FILTER ({GRADED_SERVED} AND cache_disagreement) AS within_1s_disagreeing,
    count(*) FILTER (admitted AND NOT coalesce(explore, false) AND predicted_within_bound
                     AND actual_within_bound IS NOT NULL) AS promised,
    count(*) FILTER (underprediction) AS underpredicted,
    count(*) FILTER (status = 'served' AND cache_source = 'approximate') AS approximate_credit,
    count(*) FILTER (status = 'served' AND engine_cached_tokens IS NULL) AS reuse_unknown
FROM g
"""
    )
    row = _row(con, sql, [*filters.params(), list(QUANTILES), list(QUANTILES)])
    return Overview(**row)


@dataclass(frozen=True, slots=True)
class FalseAlarms:
    """Estimated false alarms (rejected, but would have been served within the bound),
    two ways (PRODUCT.md §4). ``rejected``: rejections that carried a bound."""

    rejected: int  # the predictor's own would-be rejections (the ones explore samples)
    explore_served: int  # would-be rejections admitted anyway (explore), outcome known
    explore_within: int  # … of which the actual TTFT met the bound
    covered: int  # rejections whose predicted-TTFT bin has enough served samples
    expected_covered: float | None  # Σ P(actual ≤ B | predicted bin) over those
    # Σ over bounds of rejected × that bound's explore rate (the false_alarms view's sum);
    # a bound without explores adds nothing (unknown), as in the report
    explore_sum: float | None = None

    @property
    def explore_rate(self) -> float | None:
        return self.explore_within / self.explore_served if self.explore_served else None

    @property
    def explore_estimate(self) -> float | None:
        if self.explore_sum is not None:
            return self.explore_sum
        rate = self.explore_rate
        return None if rate is None else rate * self.rejected

    @property
    def distribution_rate(self) -> float | None:
        if not self.covered or self.expected_covered is None:
            return None
        return self.expected_covered / self.covered

    @property
    def distribution_estimate(self) -> float | None:
        """Over the rejections the served requests can speak for (their bin has support),
        not extrapolated to the others (nor to rejections without a prediction)."""
        return self.expected_covered if self.covered else None


def false_alarms(
    con: duckdb.DuckDBPyConnection, filters: Filters, bound: float | None = None
) -> FalseAlarms:
    """Over every bound, or only requests carrying ``bound``."""
    sql = (
        FILTERED
        + """
, b AS (SELECT * FROM g WHERE ?::DOUBLE IS NULL OR max_queue_wait_s = ?::DOUBLE)
, served AS (
    SELECT floor(log10(predicted_ttft_s) * ?) AS bin, actual_ttft_s
    FROM g
    WHERE status = 'served' AND predicted_ttft_s > 0 AND actual_ttft_s IS NOT NULL
)
, rejected AS (
    SELECT floor(log10(predicted_ttft_s) * ?) AS bin, max_queue_wait_s AS bound, count(*) AS n
    FROM b  -- the predictor's own would-be rejections, as per_bound's (PRODUCT.md §4)
    WHERE status = 'rejected' AND predicted_ttft_s > 0 AND max_queue_wait_s IS NOT NULL
      AND NOT fallback AND coalesce(reject_reason, 'predicted_ttft_exceeds_bound')
          IN ('predicted_ttft_exceeds_bound', 'prefill_exceeds_bound', 'overloaded')
    GROUP BY ALL
)
, per_bin AS (
    SELECT r.bin, r.bound, any_value(r.n) AS n, count(s.actual_ttft_s) AS support,
           avg((s.actual_ttft_s <= r.bound)::INT) AS p_within
    FROM rejected r LEFT JOIN served s USING (bin)
    GROUP BY r.bin, r.bound
)
, per_bound AS (
    SELECT max_queue_wait_s AS bound,
           count(*) FILTER (NOT admitted AND NOT fallback AND coalesce(reject_reason,
               'predicted_ttft_exceeds_bound') IN ('predicted_ttft_exceeds_bound',
               'prefill_exceeds_bound', 'overloaded')) AS rejected,
           count(*) FILTER (admitted AND explore AND status <> 'missing_outcome') AS explored,
           count(*) FILTER (admitted AND explore AND actual_within_bound) AS within
    FROM b WHERE max_queue_wait_s IS NOT NULL GROUP BY 1
)
SELECT
    (SELECT coalesce(sum(rejected), 0) FROM per_bound) AS rejected,
    (SELECT coalesce(sum(explored), 0) FROM per_bound) AS explore_served,
    (SELECT coalesce(sum(within), 0) FROM per_bound) AS explore_within,
    (SELECT sum(rejected * within / explored) FROM per_bound WHERE explored > 0) AS explore_sum,
    (SELECT coalesce(sum(n), 0) FROM per_bin WHERE support >= ?) AS covered,
    (SELECT sum(n * p_within) FROM per_bin WHERE support >= ?) AS expected_covered
"""
    )
    params = [*filters.params(), bound, bound, BINS_PER_DECADE, BINS_PER_DECADE]
    row = _row(con, sql, [*params, MIN_BIN_SUPPORT, MIN_BIN_SUPPORT])
    return FalseAlarms(
        rejected=int(row["rejected"]),
        explore_served=int(row["explore_served"]),
        explore_within=int(row["explore_within"]),
        covered=int(row["covered"]),
        expected_covered=row["expected_covered"],
        explore_sum=row["explore_sum"],
    )


def trend_bucket_s(span_s: float) -> int:
    """Hourly when the lake spans enough hours, else the largest finer width that still
    gives MIN_TREND_BUCKETS points."""
    for width in TREND_WIDTHS_S:
        if span_s / width >= MIN_TREND_BUCKETS:
            return width
    return TREND_WIDTHS_S[-1]


def trend(con: duckdb.DuckDBPyConnection, filters: Filters, bucket_s: int) -> pl.DataFrame:
    sql = (
        FILTERED
        + f"""
SELECT
    make_timestamp(CAST(floor(ts / ?) * ? * 1000000 AS BIGINT)) AS bucket,
    count(*) AS requests,
    count(*) FILTER (status = 'served') AS served,
    count(*) FILTER (status = 'rejected') AS rejected,
    avg((abs(error_s) <= 1)::INT) FILTER ({GRADED_SERVED}) AS within_1s,
    avg((abs(error_s) <= 10)::INT) FILTER ({GRADED_SERVED}) AS within_10s,
    avg(cache_disagreement::INT) FILTER (status = 'served') AS disagreement,
    count(*) FILTER (underprediction) AS underpredicted,
    quantile_cont(actual_ttft_s, 0.5) FILTER (status = 'served') AS actual_p50_s,
    quantile_cont(actual_ttft_s, 0.95) FILTER (status = 'served') AS actual_p95_s
FROM g
GROUP BY 1
ORDER BY 1
"""
    )
    return _frame(con, sql, [*filters.params(), bucket_s, bucket_s])


# Breakdown keys → SQL expressions: a fixed table, chosen by key (never user text).
BREAKDOWNS: Final = {
    "model": "model",
    "worker": "coalesce(worker_id, '(not routed)')",
    "workload class": "workload_class",
    # engines' KV events, or approximate (engines without events, credited from routes)
    "cache source": "coalesce(cache_source, 'events')",
    "hour": "strftime(make_timestamp(CAST(floor(ts / 3600) * 3600000000 AS BIGINT)),"
    " '%Y-%m-%d %H:00')",
}


def breakdown(con: duckdb.DuckDBPyConnection, filters: Filters, by: str) -> pl.DataFrame:
    """Tails and same-side-of-bound counts per model, worker, class or hour."""
    key = BREAKDOWNS[by]
    sql = (
        FILTERED
        + f"""
SELECT
    {key} AS "{by}",
    count(*) AS requests,
    count(*) FILTER (status = 'served') AS served,
    count(*) FILTER (status = 'rejected') AS rejected,
    count(*) FILTER ({GRADED_SERVED}) AS predicted,
    avg((abs(error_s) <= 1)::INT) FILTER ({GRADED_SERVED}) AS within_1s,
    avg((abs(error_s) <= 10)::INT) FILTER ({GRADED_SERVED}) AS within_10s,
    quantile_cont(abs(error_s), 0.5) FILTER ({GRADED_SERVED}) AS abs_error_p50_s,
    quantile_cont(abs(error_s), 0.95) FILTER ({GRADED_SERVED}) AS abs_error_p95_s,
    quantile_cont(abs(error_s), 0.99) FILTER ({GRADED_SERVED}) AS abs_error_p99_s,
    quantile_cont(actual_ttft_s, 0.5) FILTER (status = 'served') AS actual_p50_s,
    quantile_cont(actual_ttft_s, 0.95) FILTER (status = 'served') AS actual_p95_s,
    quantile_cont(actual_ttft_s, 0.99) FILTER (status = 'served') AS actual_p99_s,
    avg(cache_disagreement::INT) FILTER (status = 'served') AS disagreement,
    count(*) FILTER (underprediction) AS underpredicted  -- the graded view's (PRODUCT.md §4)
FROM g
GROUP BY 1
ORDER BY 1
"""
    )
    return _frame(con, sql, filters.params())


# --------------------------------------------------------------------------- predictions


def scatter(
    con: duckdb.DuckDBPyConnection, filters: Filters, limit: int, *, predicted: bool = True
) -> pl.DataFrame:
    """Served requests with a positive TTFT — and, if ``predicted``, a positive prediction
    (log axes) — a stable sample of at most ``limit``."""
    sql = (
        FILTERED
        + """
SELECT request_id, model, worker_id, workload_class, prompt_tokens,
       predicted_ttft_s, actual_ttft_s, error_s,
       credited_cached_tokens, engine_cached_tokens,
       coalesce(cache_disagreement, false) AS cache_disagreement,
       CASE WHEN cache_disagreement IS NULL THEN 'unknown'
            WHEN cache_disagreement THEN 'disagrees' ELSE 'agrees' END AS cache_view,
       coalesce(cache_source, 'events') AS cache_source
FROM g
WHERE status = 'served' AND actual_ttft_s > 0 AND (NOT ? OR predicted_ttft_s > 0)
ORDER BY hash(request_id)
LIMIT ?
"""
    )
    return _frame(con, sql, [*filters.params(), predicted, limit])


def fits(con: duckdb.DuckDBPyConnection, filters: Filters) -> pl.DataFrame:
    """Each worker's latest fit, as used by its most recent graded request."""
    sql = (
        FILTERED
        + """
SELECT worker_id,
       arg_max(fit_a, ts) AS fit_a,
       arg_max(fit_b, ts) AS fit_b,
       arg_max(fit_samples, ts) AS fit_samples,
       arg_max(fit_default, ts) AS fit_default,
       to_timestamp(max(ts)) AS last_used
FROM g
WHERE worker_id IS NOT NULL AND fit_a IS NOT NULL AND fit_b IS NOT NULL
GROUP BY worker_id
ORDER BY worker_id
"""
    )
    return _frame(con, sql, filters.params())


def fit_table(fits: pl.DataFrame) -> pl.DataFrame:
    """:func:`fits` for people: a and b per million tokens (as PRODUCT.md quotes them) and
    what a cold 100k / 1M-token prompt costs."""
    a_m, b_m = pl.col("fit_a") * TOKENS_PER_M, pl.col("fit_b") * TOKENS_PER_M**2
    return fits.select(
        pl.col("worker_id").alias("worker"),
        a_m.round(2).alias("a (s per M tokens)"),
        b_m.round(2).alias("b (s per M² tokens)"),
        (0.1 * a_m + 0.01 * b_m).round(2).alias("cold 100k (s)"),
        (a_m + b_m).round(1).alias("cold 1M (s)"),
        pl.col("fit_samples").alias("samples"),
        pl.when(pl.col("fit_default")).then(pl.lit("default")).otherwise(pl.lit("fitted"))
        .alias("curve"),
        pl.col("last_used").alias("last used (UTC)"),
    )  # fmt: skip


def cold_samples(con: duckdb.DuckDBPyConnection, filters: Filters, per_worker: int) -> pl.DataFrame:
    """Served requests that look like the fits' cold samples (as
    ``foretoken.core.cost.registry.select_cold_sample``, minus "nothing else running", which the
    lake does not record): admitted, the engine reported nothing cached, no queued tokens
    ahead at routing, at least MIN_COLD_PROMPT_TOKENS tokens. A stable sample per worker."""
    sql = (
        FILTERED
        + """
SELECT worker_id, prompt_tokens, actual_ttft_s
FROM g
WHERE status = 'served' AND admitted AND worker_id IS NOT NULL AND actual_ttft_s > 0
  AND engine_cached_tokens = 0
  AND queue_tokens_ahead = 0 AND prompt_tokens >= ?
QUALIFY row_number() OVER (PARTITION BY worker_id ORDER BY hash(request_id)) <= ?
ORDER BY worker_id, prompt_tokens
"""
    )
    return _frame(con, sql, [*filters.params(), MIN_COLD_PROMPT_TOKENS, per_worker])


# --------------------------------------------------------------------------- bounds


def bound_summary(con: duckdb.DuckDBPyConnection, filters: Filters) -> pl.DataFrame:
    """Per bound the lake carries: traffic, actual-within-bound and the grades."""
    sql = (
        FILTERED
        + """
SELECT
    max_queue_wait_s AS bound_s,
    count(*) AS requests,
    count(*) FILTER (status = 'served') AS served,
    count(*) FILTER (status = 'rejected') AS rejected,
    count(*) FILTER (explore) AS explore,
    avg((actual_ttft_s <= max_queue_wait_s)::INT) FILTER (status = 'served') AS served_within,
    count(*) FILTER (underprediction) AS underpredicted
FROM g
WHERE max_queue_wait_s IS NOT NULL
GROUP BY 1
ORDER BY 1
"""
    )
    return _frame(con, sql, filters.params())


@dataclass(frozen=True, slots=True)
class BoundMatrix:
    """Served requests by side of the bound B: ``cells[(predicted ≤ B, actual ≤ B)]``
    (only requests with a prediction), plus those without one by actual side."""

    bound_s: float
    cells: dict[tuple[bool, bool], int]
    unpredicted_within: int
    unpredicted_over: int

    @property
    def predicted_total(self) -> int:
        return sum(self.cells.values())


def bound_matrix(
    con: duckdb.DuckDBPyConnection, filters: Filters, bound_s: float, *, what_if: bool
) -> BoundMatrix:
    """Requests that carried ``bound_s`` — or, ``what_if``, every served request judged
    against ``bound_s`` as if it had been its bound. Predicted side: the admission test,
    already waited + predicted ≤ B (the actual TTFT counts the wait already)."""
    sql = (
        FILTERED
        + """
, p AS (SELECT ?::DOUBLE AS bound, ?::BOOLEAN AS what_if)
SELECT coalesce(already_waited_s, 0) + predicted_ttft_s <= bound AS predicted_within,
       actual_ttft_s <= bound AS actual_within,
       count(*) AS n
FROM g, p
WHERE status = 'served' AND actual_ttft_s IS NOT NULL
  AND (what_if OR max_queue_wait_s = bound)
GROUP BY ALL
"""
    )
    cells = {(p, a): 0 for p in (True, False) for a in (True, False)}
    within = over = 0
    for row in _frame(con, sql, [*filters.params(), bound_s, what_if]).iter_rows(named=True):
        predicted, actual, n = row["predicted_within"], bool(row["actual_within"]), int(row["n"])
        if predicted is None:
            within, over = (within + n, over) if actual else (within, over + n)
        else:
            cells[(bool(predicted), actual)] += n
    return BoundMatrix(bound_s, cells, within, over)
