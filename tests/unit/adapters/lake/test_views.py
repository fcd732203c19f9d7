"""The grading lake (grading/lake.py) and its DuckDB views (sql/, grading/views.py) against
grades computed by hand.

The golden lake: ten requests, block size 16, hour 00 unless said (B = max_queue_wait_s;
|e| = |predicted − actual|):

====  =======  =====  =====  ====  ==========  =======  ======  ==  =====  ============
id    status   model  work.  cls   explore     pred s   act s   B   |e|    disagreement
====  =======  =====  =====  ====  ==========  =======  ======  ==  =====  ============
r1    served   m1     w1     chat              2        1.5     5   0.5    no (32/32)
r2    served   m1     w1     chat              3        5       5   2      yes (64/32)
r3    served   m1     w2     code              4        16      10  12     no (0/8)
r4    served   m2     w2     code              1        1       —   0      unknown
r5    rejected m1     —      chat              12       —       10
r6    rejected m2     —      code              8        —       5
r7    served   m1     w1     chat  explore     7        4       5   3      no (16/16)
r8    served   m2     w2     code  explore     15       12      10  3      no (0/0)
r9    served   m2     w1     chat  (hour 01)   30       9       30  21     yes (0/160)
r10   error    m1     w2     code  (hour 01)   2        —       5
====  =======  =====  =====  ====  ==========  =======  ======  ==  =====  ============

r3 is delivered twice: again in a later file of hour 00, with output_tokens 9 instead of 7.
So hour 00 has two files (the dedupe path) and hour 01 one.

Quantiles are DuckDB's ``quantile_cont`` (linear between order statistics): for sorted
values v_0..v_{n−1} the q-quantile sits at position q·(n − 1).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pytest

from foretoken.adapters.lake import writer as lake_module
from foretoken.adapters.lake.views import (
    connect,
    lake_glob,
    metric,
    metric_names,
    query,
    rows,
    view_names,
)
from foretoken.adapters.lake.writer import (
    LAKE_TABLE,
    LakeWriter,
    graded_frame,
    graded_schema,
    hour_dirs,
    part_files,
    write_lake,
)
from foretoken.bench.lake_bench import generate, polars_accuracy_by_hour, write
from foretoken.wire.records import Graded

HOUR0 = 1_735_689_600.0  # 2025-01-01T00:00:00Z
HOUR1 = HOUR0 + 3600.0
Z = 1.959963984540054


def rec(rid: str, **fields: Any) -> Graded:
    base: dict[str, Any] = {
        "request_id": rid,
        "ts": HOUR0 + 10.0,
        "model": "m1",
        "workload_class": "chat",
        "worker_id": None,
        "status": "served",
        "admitted": True,
        "prompt_tokens": 1000,
        "block_size": 16,
    }
    base.update(fields)
    predicted, actual = base.get("predicted_ttft_s"), base.get("actual_ttft_s")
    if predicted is not None and actual is not None:
        base["error_s"] = predicted - actual
    return Graded(**base)


def served(rid: str, worker: str, pred: float, act: float, bound: float | None, credited: int,
           engine: int | None, **kw: Any) -> Graded:  # fmt: skip
    disagreement = None if engine is None else abs(credited - engine) >= 16
    return rec(rid, worker_id=worker, predicted_ttft_s=pred, actual_ttft_s=act,
               max_queue_wait_s=bound, credited_cached_tokens=credited,
               engine_cached_tokens=engine, cache_disagreement=disagreement,
               output_tokens=7, **kw)  # fmt: skip


GOLDEN = [
    served("r1", "w1", 2.0, 1.5, 5.0, 32, 32),
    served("r2", "w1", 3.0, 5.0, 5.0, 64, 32),
    served("r3", "w2", 4.0, 16.0, 10.0, 0, 8, workload_class="code"),
    served("r4", "w2", 1.0, 1.0, None, 0, None, model="m2", workload_class="code"),
    rec("r5", status="rejected", admitted=False, predicted_ttft_s=12.0, max_queue_wait_s=10.0),
    rec("r6", status="rejected", admitted=False, predicted_ttft_s=8.0, max_queue_wait_s=5.0,
        model="m2", workload_class="code"),
    served("r7", "w1", 7.0, 4.0, 5.0, 16, 16, explore=True),
    served("r8", "w2", 15.0, 12.0, 10.0, 0, 0, explore=True, model="m2", workload_class="code"),
    served("r9", "w1", 30.0, 9.0, 30.0, 0, 160, model="m2", ts=HOUR1 + 5.0),
    rec("r10", status="error", worker_id="w2", predicted_ttft_s=2.0, max_queue_wait_s=5.0,
        workload_class="code", ts=HOUR1 + 6.0),
]  # fmt: skip
REDELIVERED_R3 = served("r3", "w2", 4.0, 16.0, 10.0, 0, 8, workload_class="code")
REDELIVERED_R3 = Graded(**{**{f: getattr(REDELIVERED_R3, f) for f in graded_schema()},
                           "output_tokens": 9})  # fmt: skip


def build_golden(root: Path) -> LakeWriter:
    writer = LakeWriter(root)
    writer.append(GOLDEN)
    writer.append([REDELIVERED_R3])
    return writer


@pytest.fixture()
def golden(tmp_path: Path) -> Iterator[duckdb.DuckDBPyConnection]:
    build_golden(tmp_path)
    con = connect(tmp_path)
    yield con
    con.close()


def by(frame_rows: list[dict[str, Any]], *keys: str) -> dict[Any, dict[str, Any]]:
    return {tuple(r[k] for k in keys) if len(keys) > 1 else r[keys[0]]: r for r in frame_rows}


def check(row: dict[str, Any], **expected: Any) -> None:
    for name, value in expected.items():
        if isinstance(value, float):
            assert row[name] == pytest.approx(value), name
        else:
            assert row[name] == value, name


# --------------------------------------------------------------------------- golden views


def test_the_views_are_the_sql_files() -> None:
    assert view_names() == [
        "lake_files", "graded_raw", "graded", "accuracy_by_hour", "by_worker", "by_model",
        "by_class", "cache_disagreement", "cache_sources", "bounds", "false_alarms",
    ]  # fmt: skip
    assert set(metric_names()) >= {"totals", "within_1s", "within_10s", "abs_error_quantiles"}


def test_graded_keeps_one_row_per_request_the_latest_written(
    golden: duckdb.DuckDBPyConnection,
) -> None:
    assert rows(golden, "SELECT count(*) AS n FROM lake_files")[0]["n"] == 3
    assert rows(golden, "SELECT count(*) AS n FROM graded_raw")[0]["n"] == 11
    graded = by(rows(golden, "SELECT * FROM graded"), "request_id")
    assert sorted(graded) == sorted(f"r{i}" for i in range(1, 11))
    assert graded["r3"]["output_tokens"] == 9  # the re-delivery, written later
    check(graded["r2"], abs_error_s=2.0, within_1s=False, within_10s=True,
          predicted_within_bound=True, actual_within_bound=True, underprediction=False,
          hour="2025-01-01T00")  # fmt: skip
    check(graded["r3"], abs_error_s=12.0, within_10s=False, underprediction=True)
    check(graded["r9"], hour="2025-01-01T01", within_1s=False)
    # Not served: no TTFT grades.
    for rid in ("r5", "r10"):
        assert graded[rid]["abs_error_s"] is None and graded[rid]["within_1s"] is None
        assert not graded[rid]["underprediction"]


def test_totals_and_headline_metrics(golden: duckdb.DuckDBPyConnection) -> None:
    check(metric(golden, "totals"), requests=10, served=7, rejected=2, errors=1, cancelled=0,
          missing_outcome=0, explore_admitted=2, graded=7, hours=2)  # fmt: skip
    # |e| over the 7 served: 0, 0.5, 2, 3, 3, 12, 21.
    check(metric(golden, "within_1s"), graded=7, within_1s=2 / 7)
    check(metric(golden, "within_10s"), graded=7, within_10s=5 / 7)
    check(
        metric(golden, "abs_error_quantiles"),
        abs_error_p50_s=3.0,  # position 3
        abs_error_p95_s=12 + 0.7 * 9,  # position 5.7: between 12 and 21
        abs_error_p99_s=12 + 0.94 * 9,  # position 5.94
        abs_error_max_s=21.0,
    )
    # Bounds 5 / 10 / 30: promised 2 + 1 + 1, one underprediction (r3); same side 2 + 1 + 1
    # of 3 + 2 + 1 served with a bound and a prediction.
    check(metric(golden, "underpredictions"), promised=4, underpredictions=1,
          underprediction_rate=0.25, same_side=4, same_side_fraction=4 / 6)  # fmt: skip
    check(metric(golden, "cache_disagreement_rate"), known=6, disagreeing=2,
          disagreement_rate=1 / 3)  # fmt: skip


def test_accuracy_by_hour(golden: duckdb.DuckDBPyConnection) -> None:
    hours = by(rows(golden, "SELECT * FROM accuracy_by_hour"), "hour")
    # Hour 00: r1–r8; |e| of r1 r2 r3 r4 r7 r8 sorted: 0, 0.5, 2, 3, 3, 12.
    check(hours["2025-01-01T00"], requests=8, served=6, rejected=2, graded=6,
          within_1s=2 / 6, within_10s=5 / 6,
          abs_error_p50_s=2.5,  # position 2.5: halfway from 2 to 3
          abs_error_p95_s=3 + 0.75 * 9,  # position 4.75: from 3 towards 12
          abs_error_p99_s=3 + 0.95 * 9,
          # With a bound: r1 r2 r3 r7 r8; same side: r1, r2 (both within), r8 (both over).
          bounded=5, same_side=3, underpredictions=1)  # fmt: skip
    check(hours["2025-01-01T01"], requests=2, served=1, rejected=0, graded=1, within_1s=0.0,
          within_10s=0.0, abs_error_p50_s=21.0, abs_error_p99_s=21.0, bounded=1, same_side=1,
          underpredictions=0)  # fmt: skip


def test_by_model_worker_and_class(golden: duckdb.DuckDBPyConnection) -> None:
    models = by(rows(golden, "SELECT * FROM by_model"), "model")
    # m1: r1 r2 r3 r5 r7 r10; |e| 0.5, 2, 3, 12.
    check(models["m1"], requests=6, served=4, rejected=1, graded=4, within_1s=0.25,
          within_10s=0.75, abs_error_p50_s=2.5, abs_error_p95_s=3 + 0.85 * 9,
          abs_error_p99_s=3 + 0.97 * 9, bounded=4, same_side=2, underpredictions=1)  # fmt: skip
    # m2: r4 r6 r8 r9; |e| 0, 3, 21.
    check(models["m2"], requests=4, served=3, rejected=1, within_1s=1 / 3, within_10s=2 / 3,
          abs_error_p50_s=3.0, abs_error_p95_s=3 + 0.9 * 18, bounded=2, same_side=2,
          underpredictions=0)  # fmt: skip
    workers = by(rows(golden, "SELECT * FROM by_worker"), "model", "worker_id")
    check(workers[("m1", "w1")], requests=3, served=3, within_1s=1 / 3, within_10s=1.0,
          abs_error_p50_s=2.0, bounded=3, same_side=2)  # fmt: skip
    check(workers[("m1", "w2")], requests=2, served=1, within_10s=0.0, underpredictions=1)
    check(workers[("m1", None)], requests=1, served=0, rejected=1, graded=0, within_1s=None)
    check(workers[("m2", "w2")], requests=2, served=2, within_1s=0.5, abs_error_p50_s=1.5)
    check(workers[("m2", "w1")], requests=1, abs_error_p50_s=21.0)
    check(workers[("m2", None)], rejected=1)
    assert len(workers) == 6
    classes = by(rows(golden, "SELECT * FROM by_class"), "workload_class")
    check(classes["chat"], requests=5, served=4, rejected=1, within_1s=0.25, within_10s=0.75,
          abs_error_p50_s=2.5, bounded=4, same_side=3, underpredictions=0)  # fmt: skip
    check(classes["code"], requests=5, served=3, rejected=1, within_1s=1 / 3,
          within_10s=2 / 3, abs_error_p50_s=3.0, bounded=2, same_side=1,
          underpredictions=1)  # fmt: skip


def test_cache_disagreement_split(golden: duckdb.DuckDBPyConnection) -> None:
    # Known on r1 r2 r3 r7 r8 r9 (r4's engine said nothing); r2 and r9 disagree.
    (row,) = rows(golden, "SELECT * FROM cache_disagreement")
    check(row, known=6, disagreeing=2, disagreement_rate=1 / 3,
          graded_agreeing=4, within_1s_agreeing=0.25,  # r1 of r1 r3 r7 r8
          graded_disagreeing=2, within_1s_disagreeing=0.0)  # fmt: skip


def test_bounds(golden: duckdb.DuckDBPyConnection) -> None:
    bounds = by(rows(golden, "SELECT * FROM bounds"), "bound_s")
    assert sorted(bounds) == [5.0, 10.0, 30.0]
    # B = 5: r1 r2 r6 r7 r10. r2's actual is exactly B: within, not an underprediction.
    check(bounds[5.0], requests=5, admitted=4, rejected=1, explore_admitted=1, served=3,
          promised=2, underpredictions=0, underprediction_rate=0.0,
          predicted_within_actual_within=2, predicted_within_actual_over=0,
          predicted_over_actual_within=1, predicted_over_actual_over=0,
          same_side=2, same_side_fraction=2 / 3)  # fmt: skip
    # B = 10: r3 (underprediction), r5 (rejected), r8 (explore, over and over).
    check(bounds[10.0], requests=3, admitted=2, rejected=1, explore_admitted=1, served=2,
          promised=1, underpredictions=1, underprediction_rate=1.0,
          predicted_within_actual_within=0, predicted_within_actual_over=1,
          predicted_over_actual_within=0, predicted_over_actual_over=1,
          same_side=1, same_side_fraction=0.5)  # fmt: skip
    check(bounds[30.0], requests=1, admitted=1, rejected=0, promised=1, underpredictions=0,
          predicted_within_actual_within=1, same_side_fraction=1.0)  # fmt: skip


def test_false_alarms_direct_estimate(golden: duckdb.DuckDBPyConnection) -> None:
    alarms = by(rows(golden, "SELECT * FROM false_alarms"), "bound_s")
    # B = 5: one explore admission (r7), served within; Wilson for 1 of 1 is
    # [1/(1 + z²), 1]; one rejection (r6) → 1 estimated false alarm.
    check(alarms[5.0], rejected=1, explore_admitted=1, explore_within=1, within_fraction=1.0,
          within_fraction_lo=1 / (1 + Z * Z), within_fraction_hi=1.0,
          estimated_false_alarms=1.0, estimated_false_alarms_lo=1 / (1 + Z * Z),
          estimated_false_alarms_hi=1.0)  # fmt: skip
    # B = 10: r8 took 12 s > 10: 0 of 1, Wilson [0, z²/(1 + z²)].
    check(alarms[10.0], rejected=1, explore_admitted=1, explore_within=0, within_fraction=0.0,
          within_fraction_lo=0.0, within_fraction_hi=Z * Z / (1 + Z * Z),
          estimated_false_alarms=0.0)  # fmt: skip
    # B = 30: no explore admission, nothing to estimate from.
    check(alarms[30.0], rejected=0, explore_admitted=0, within_fraction=None,
          within_fraction_lo=None, within_fraction_hi=None,
          estimated_false_alarms=None)  # fmt: skip


# --------------------------------------------------------------------------- writer


def view_numbers(con: duckdb.DuckDBPyConnection) -> dict[str, list[dict[str, Any]]]:
    views = ["accuracy_by_hour", "by_worker", "by_model", "by_class", "cache_disagreement",
             "bounds", "false_alarms"]  # fmt: skip
    numbers = {v: rows(con, f"SELECT * FROM {v}") for v in views}
    numbers["graded"] = rows(con, "SELECT * EXCLUDE (source_file) FROM graded ORDER BY request_id")
    return numbers


def test_compaction_keeps_every_number_and_leaves_one_file_per_hour(tmp_path: Path) -> None:
    writer = build_golden(tmp_path)
    writer.append(GOLDEN[8:9])  # r9 again: hour 01 gets a second file too
    con = connect(tmp_path)
    before = view_numbers(con)
    done = writer.compact()
    assert sorted((c.hour, c.merged_files, c.rows_in, c.rows_out) for c in done) == [
        ("2025-01-01T00", 2, 9, 8),
        ("2025-01-01T01", 2, 3, 2),
    ]
    assert [len(part_files(d)) for d in hour_dirs(tmp_path).values()] == [1, 1]
    assert view_numbers(con) == before
    assert rows(con, "SELECT count(*) AS n FROM graded_raw")[0]["n"] == 10
    assert writer.compact() == []  # nothing left to merge


def test_readers_see_no_gap_and_no_double_count_during_compaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The merged file appears (rename) before any input is deleted; at every step of the
    deletions the views give the same numbers."""
    writer = build_golden(tmp_path)
    con = connect(tmp_path)
    before = view_numbers(con)
    seen: list[tuple[int, dict[str, Any]]] = []
    real_unlink = Path.unlink

    def unlink_and_look(path: Path, missing_ok: bool = False) -> None:
        if path.suffix == ".parquet":
            seen.append((len(query(con, "SELECT * FROM lake_files")), view_numbers(con)))
        real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink_and_look)
    writer.compact()
    # Before each of the two deletions in hour 00: old files plus the merged one.
    assert [files for files, _ in seen] == [4, 3]
    assert all(numbers == before for _, numbers in seen)


def test_append_dedupes_a_batch_keeping_the_last_record(tmp_path: Path) -> None:
    first = GOLDEN[0]
    again = Graded(**{**{f: getattr(first, f) for f in graded_schema()}, "output_tokens": 99})
    (path,) = write_lake([first, GOLDEN[1], again], tmp_path)
    frame = pl.read_parquet(path)
    assert frame["request_id"].to_list() == ["r2", "r1"]
    assert frame.filter(pl.col("request_id") == "r1")["output_tokens"].item() == 99


def test_files_hold_the_graded_schema_and_ttft_grades_only_on_served_rows(tmp_path: Path) -> None:
    odd = rec("x", status="error", predicted_ttft_s=2.0, actual_ttft_s=1.0)  # error_s 1.0
    (path,) = LakeWriter(tmp_path).append([odd])
    frame = pl.read_parquet(path)
    assert frame.schema == pl.Schema(graded_schema())
    assert frame["actual_ttft_s"].item() is None and frame["error_s"].item() is None
    assert frame["predicted_ttft_s"].item() == 2.0
    assert path.name.startswith("part-") and not list(tmp_path.rglob("*.tmp"))
    with connect(tmp_path) as con:
        described = query(con, "DESCRIBE graded_raw")["column_name"].to_list()
    assert described == [*graded_schema(), "hour", "filename"]


def test_hidden_partial_files_are_never_read_and_stale_ones_are_swept(tmp_path: Path) -> None:
    writer = build_golden(tmp_path)
    hour = hour_dirs(tmp_path)["2025-01-01T00"]
    partial = hour / ".part-00000000000000000001-dead.parquet.tmp"
    partial.write_bytes(b"PAR1 half a file")
    with connect(tmp_path) as con:
        assert metric(con, "totals")["requests"] == 10
    old = time.time() - 2 * lake_module.STALE_TMP_S
    os.utime(partial, (old, old))
    writer.compact()
    assert not partial.exists()


def test_an_empty_lake_has_empty_typed_views(tmp_path: Path) -> None:
    with connect(tmp_path / "nothing-yet") as con:
        for view in view_names():
            query(con, f"SELECT * FROM {view}")
        assert metric(con, "totals")["requests"] == 0
        assert metric(con, "underpredictions")["promised"] == 0
        types = dict(query(con, "DESCRIBE graded").select("column_name", "column_type").rows())
    assert types["error_s"] == "DOUBLE" and types["admitted"] == "BOOLEAN"
    assert types["within_1s"] == "BOOLEAN" and types["hour"] == "VARCHAR"


def test_files_written_after_connect_are_seen(tmp_path: Path) -> None:
    with connect(tmp_path) as con:
        assert metric(con, "totals")["requests"] == 0
        build_golden(tmp_path)
        assert metric(con, "totals")["requests"] == 10


def test_a_foreign_parquet_file_in_the_lake_is_not_counted_as_requests(tmp_path: Path) -> None:
    """Its rows (no request id) used to count as requests with no status."""
    build_golden(tmp_path)
    hour = next((tmp_path / LAKE_TABLE).iterdir())
    pl.DataFrame({"x": [1, 2], "y": ["a", "b"]}).write_parquet(hour / "part-zzz-foreign.parquet")
    with connect(tmp_path) as con:
        assert metric(con, "totals")["requests"] == 10


def test_the_lake_path_is_quoted_not_spliced(tmp_path: Path) -> None:
    odd = tmp_path / "it's a lake; DROP VIEW graded; --"
    build_golden(odd)
    with connect(odd) as con:
        assert metric(con, "totals")["requests"] == 10
    with pytest.raises(ValueError, match="glob"):
        lake_glob(tmp_path / "lake*")


def test_fleet_replay_writes_through_the_one_lake_writer(tmp_path: Path) -> None:
    from foretoken.sim import replay

    assert replay.write_lake is write_lake and replay.graded_frame is graded_frame
    replay.write_lake(GOLDEN, tmp_path)
    with connect(tmp_path) as con:
        assert metric(con, "totals")["requests"] == 10


def test_accuracy_by_hour_matches_an_independent_polars_computation(tmp_path: Path) -> None:
    """A generated lake (compacted hours, live hours with several files and
    re-deliveries) against the same aggregation written in polars."""
    write(tmp_path, generate(6000, seed=3), seed=3)
    with connect(tmp_path) as con:
        duck = query(con, "SELECT * FROM accuracy_by_hour")
        assert metric(con, "totals")["requests"] == 6000
    polar = polars_accuracy_by_hour(tmp_path)
    assert duck.columns == polar.columns and duck.height == polar.height
    for name in duck.columns:
        left, right = duck[name].to_list(), polar[name].to_list()
        if duck[name].dtype.is_float():
            assert all(
                (a is None and b is None) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
                for a, b in zip(left, right, strict=True)
            ), name
        else:
            assert left == right, name


class _FlakyCursor:
    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def __enter__(self) -> _FlakyCursor:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def sql(self, sql: str, params: object = None) -> Any:
        if self.fail:
            raise duckdb.IOException("IO Error: Cannot open file (compacted away)")
        return duckdb.sql("SELECT 42 AS answer")


class _Flaky:
    """A connection whose first query races a compaction."""

    def __init__(self, failures: int) -> None:
        self.failures = failures

    def cursor(self) -> _FlakyCursor:
        self.failures -= 1
        return _FlakyCursor(self.failures >= 0)


def test_a_query_that_races_a_compaction_is_run_again() -> None:
    assert query(_Flaky(failures=1), "SELECT 42").item() == 42  # type: ignore[arg-type]
    with pytest.raises(duckdb.IOException):
        query(_Flaky(failures=5), "SELECT 42")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- audit regressions


def test_a_name_value_directory_above_the_lake_is_no_column(tmp_path: Path) -> None:
    """DuckDB's hive partitioning took every `name=value` directory of the path as a column:
    a lake under `model=x/` read every row's model as "x", one under `hour=x/` every hour as
    "x", which also switched the per-request-id dedupe off (a re-delivery counted twice)."""
    for parent in ("model=other", "hour=x", "ts=5"):
        root = tmp_path / parent / "lake"
        build_golden(root)
        with connect(root) as con:
            check(metric(con, "totals"), requests=10, hours=2, first_ts=HOUR0 + 10.0)
            assert [r["model"] for r in rows(con, "SELECT * FROM by_model")] == ["m1", "m2"]
            hours = [r["hour"] for r in rows(con, "SELECT * FROM accuracy_by_hour")]
            assert hours == ["2025-01-01T00", "2025-01-01T01"], parent


def test_an_explore_admission_is_no_promise_hence_no_underprediction(tmp_path: Path) -> None:
    """With predictor.admission_quantile the router rejects on the q-quantile, so a would-be
    rejection admitted by explore may have a point prediction ≤ B: it was never promised."""
    LakeWriter(tmp_path).append([
        served("promised", "w1", 2.0, 7.0, 5.0, 0, 0),
        served("explored", "w1", 3.0, 7.0, 5.0, 0, 0, explore=True),
    ])  # fmt: skip
    with connect(tmp_path) as con:
        check(metric(con, "underpredictions"), promised=1, underpredictions=1,
              underprediction_rate=1.0)  # fmt: skip
        (bound,) = rows(con, "SELECT * FROM bounds")
        check(bound, promised=1, underpredictions=1, explore_admitted=1,
              predicted_within_actual_over=2)  # fmt: skip
        graded = by(rows(con, "SELECT * FROM graded"), "request_id")
        assert graded["promised"]["underprediction"] and not graded["explored"]["underprediction"]


def test_a_file_compaction_cannot_merge_is_left_alone_and_blocks_no_other_hour(
    tmp_path: Path,
) -> None:
    """A foreign or unreadable file made compaction raise, and compact_closed stopped at
    that hour: every later hour stayed uncompacted for good."""
    writer = LakeWriter(tmp_path)
    for hour in range(3):
        for rid in ("a", "b"):
            writer.append([rec(f"{rid}{hour}", ts=HOUR0 + hour * 3600.0 + 1)])
    first, second = hour_dirs(tmp_path)["2025-01-01T00"], hour_dirs(tmp_path)["2025-01-01T01"]
    foreign = first / "part-zzz-foreign.parquet"
    pl.DataFrame({"x": [1]}).write_parquet(foreign)
    broken = second / "part-00000000000000000000-broken.parquet"
    broken.write_bytes(b"PAR1 cut short")
    done = writer.compact_closed(now_s=HOUR0 + 10 * 3600.0, after_s=60.0)
    assert sorted((c.hour, c.merged_files, c.rows_out) for c in done) == [
        ("2025-01-01T00", 2, 2), ("2025-01-01T01", 2, 2), ("2025-01-01T02", 2, 2)
    ]  # fmt: skip
    assert foreign.exists() and broken.exists()  # never dropped: someone else's, or evidence
    broken.unlink()
    with connect(tmp_path) as con:
        assert metric(con, "totals")["requests"] == 6
