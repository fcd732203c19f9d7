"""DuckDB views over the grading lake. The SQL lives in ``sql/``, one view per file.

:func:`connect` opens an in-memory DuckDB (a reader never locks the lake: it only reads
Parquet files, see FIELD-NOTES "DuckDB 2.0") and defines, in file-name order, every
``sql/NN_<view>.sql`` as ``CREATE VIEW <view> AS <the file's query>``:

* ``lake_files`` — the visible part files and their hour;
* ``graded_raw`` — every row of every file (re-deliveries included);
* ``graded`` — one row per request id (the latest written) plus the grades;
* ``accuracy_by_hour``, ``by_worker``, ``by_model``, ``by_class`` — tails of |error|,
  within 1 s / 10 s, same-side-of-bound counts and underpredictions per group: one table
  macro, ``accuracy_by(keys)`` (a file that starts with ``CREATE`` is run as it is);
* ``cache_disagreement`` — the disagreement rate and within 1 s for each side;
* ``bounds`` — per bound value B: admitted, rejected, underpredictions, the matrix;
* ``false_alarms`` — the direct (explore-based) estimate with a Wilson 95% interval.

``sql/metrics/<name>.sql`` are one-row metric queries over those views (:func:`metric`).

The lake's path is the only thing that enters the SQL text: once, as the string literal of
a macro ``lake_glob()`` that the views call (quoted by :func:`sql_string`; a view cannot
take a prepared parameter, and a DuckDB variable would not be visible to the cursors that
the dashboard's threads use). Everything else is fixed text; queries take ``?``
parameters. The views read the directory at every query, so files written (or compacted)
after :func:`connect` are seen by the next query.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Final

import duckdb
import polars as pl

from foretoken.adapters.lake.writer import HOUR_PARTITION, LAKE_TABLE, PART_GLOB, graded_schema

SQL_DIR: Final = Path(__file__).resolve().parent / "sql"
METRICS_DIR: Final = SQL_DIR / "metrics"
VIEW_FILE: Final = re.compile(r"^\d+_(?P<name>[a-z][a-z0-9_]*)\.sql$")
METRIC_NAME: Final = re.compile(r"^[a-z][a-z0-9_]*$")
STUB_TABLE: Final = "graded_stub"
SOURCE_COLUMN: Final = "filename"  # read_parquet(filename = true)
GLOB_CHARS: Final = frozenset("*?[]{}")
QUERY_ATTEMPTS: Final = 5


def sql_string(text: str) -> str:
    """``text`` as a SQL string literal (single quotes doubled)."""
    if "\x00" in text:
        raise ValueError("a NUL character cannot appear in a SQL string")
    return "'" + text.replace("'", "''") + "'"


def lake_glob(lake_dir: str | Path) -> str:
    """The glob of the lake's visible part files: ``LAKE/graded/hour=*/part-*.parquet``."""
    root = Path(lake_dir).resolve()
    if GLOB_CHARS & set(str(root)):
        raise ValueError(f"the lake path {str(root)!r} holds a glob character (one of *?[]{{}})")
    return str(root / LAKE_TABLE / f"{HOUR_PARTITION}=*" / PART_GLOB)


def view_files() -> list[tuple[str, Path]]:
    """(view name, file) for every view, in the order they are defined."""
    out = []
    for path in sorted(SQL_DIR.glob("*.sql")):
        match = VIEW_FILE.match(path.name)
        if match is None:
            raise ValueError(f"{path.name}: view files are named NN_<view>.sql")
        out.append((match["name"], path))
    return out


def _is_statement(text: str) -> bool:
    """A file that defines something itself (``CREATE MACRO …``) rather than a view's query."""
    code = [
        line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("--")
    ]
    return bool(code) and code[0].lstrip().upper().startswith("CREATE ")


def view_names() -> list[str]:
    return [name for name, path in view_files() if not _is_statement(path.read_text())]


def metric_names() -> list[str]:
    return sorted(path.stem for path in METRICS_DIR.glob("*.sql"))


def _create_stub(con: duckdb.DuckDBPyConnection) -> None:
    """An empty table with the lake's columns, typed from the Graded record."""
    columns = {**graded_schema(), HOUR_PARTITION: pl.String(), SOURCE_COLUMN: pl.String()}
    empty = pl.DataFrame(schema=columns).to_arrow()
    con.register("graded_stub_arrow", empty)
    con.execute(f"CREATE TABLE {STUB_TABLE} AS SELECT * FROM graded_stub_arrow")
    con.unregister("graded_stub_arrow")


def connect(lake_dir: str | Path) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with the views of ``sql/`` over the lake under ``lake_dir``
    (which may hold no file yet: the views are then empty, with every column typed)."""
    for attempt in range(QUERY_ATTEMPTS):
        con = duckdb.connect(":memory:")
        try:
            con.execute(f"CREATE MACRO lake_glob() AS {sql_string(lake_glob(lake_dir))}")
            _create_stub(con)
            for name, path in view_files():
                text = path.read_text()
                if _is_statement(text):  # a macro the views after it use
                    con.execute(text)
                else:
                    con.execute(f"CREATE VIEW {name} AS {text}")
        except duckdb.IOException:
            con.close()  # binding a view read a file that a compaction just removed
            if attempt + 1 == QUERY_ATTEMPTS:
                raise
            continue
        except BaseException:
            con.close()
            raise
        return con
    raise AssertionError("unreachable")


def query(
    con: duckdb.DuckDBPyConnection, sql: str, params: list[Any] | None = None
) -> pl.DataFrame:
    """Run one query on its own cursor (safe from threads) and fetch it whole. A query that
    races a compaction (it listed a file that was deleted before it was read) fails with an
    I/O error and is run again; it never returns wrong numbers."""
    for attempt in range(QUERY_ATTEMPTS):
        try:
            with con.cursor() as cur:
                return cur.sql(sql, params=params).pl()
        except duckdb.IOException:
            if attempt + 1 == QUERY_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def rows(
    con: duckdb.DuckDBPyConnection, sql: str, params: list[Any] | None = None
) -> list[dict[str, Any]]:
    return query(con, sql, params).to_dicts()


def metric(con: duckdb.DuckDBPyConnection, name: str) -> dict[str, Any]:
    """The one row of ``sql/metrics/<name>.sql``."""
    if not METRIC_NAME.match(name) or not (METRICS_DIR / f"{name}.sql").is_file():
        raise KeyError(f"no metric {name!r}; known: {', '.join(metric_names())}")
    found = rows(con, (METRICS_DIR / f"{name}.sql").read_text())
    return found[0] if found else {}
