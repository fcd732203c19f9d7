"""The grading report (PRODUCT.md §4) and an ad-hoc SQL shell over the lake's views.

* :func:`report` — a JSON-able summary of a lake: totals; within 1 s / 10 s and the
  p50/p95/p99 of |error|; per bound the underpredictions, the same-side-of-bound matrix
  and the false alarms estimated both ways with their intervals; cache disagreement with
  within 1 s for each side; the per model / worker / class / hour tables. Every number
  comes from the views in ``sql/`` (and :mod:`foretoken.adapters.lake.false_alarms`), the same ones
  the
  dashboard reads.
* :func:`render` — that summary as rich tables.
* :func:`sql_shell` — one query printed as a table, or a tiny REPL (``.quit`` to leave).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any, Final

import duckdb
import polars as pl
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from foretoken.adapters.lake import false_alarms
from foretoken.adapters.lake.views import connect, metric, query, rows, view_names

GROUP_VIEWS: Final = {
    "by_model": "by_model",
    "by_worker": "by_worker",
    "by_class": "by_class",
    "by_hour": "accuracy_by_hour",
}
RENDERED_HOURS: Final = 24
SHELL_MAX_ROWS: Final = 200
SHELL_DIGITS: Final = 6  # significant digits of a float in the shell
PROMPT: Final = "sql> "
QUIT: Final = (".quit", ".exit", r"\q")
# Output that is not a terminal (CI logs, `| tee`, `| cat`): rich would squeeze every table
# into 80 columns and cut its headers; there each table is printed at its natural width.
PIPED_WIDTH: Final = 160  # for text that is not a table
MAX_TABLE_WIDTH: Final = 1000


def output_console(stderr: bool = False) -> Console:
    """A console for reports: the terminal's width on a terminal; when piped, plain text
    (no colours) and tables at their natural width (:func:`print_table`)."""
    probe = Console(stderr=stderr)
    if probe.is_terminal:
        return probe
    return Console(stderr=stderr, width=PIPED_WIDTH, no_color=True)


def print_table(console: Console, table: Table) -> None:
    """Print a table; when the output is not a terminal, as wide as it needs to be."""
    if console.is_terminal:
        console.print(table)
        return
    natural = Measurement.get(console, console.options.update(width=MAX_TABLE_WIDTH), table)
    width = max(console.width, min(natural.maximum, MAX_TABLE_WIDTH))
    before = console.width  # Console.print never goes wider than its console
    console.width = width
    try:
        console.print(table)
    finally:
        console.width = before


# --------------------------------------------------------------------------- report


def _plain(value: Any) -> Any:
    """A JSON-able value: NaN/inf → None, Decimal → int/float, containers recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _per_bound(bounds: list[dict[str, Any]], estimates: dict[str, Any]) -> list[dict[str, Any]]:
    direct = {row["bound_s"]: row for row in estimates["direct"]}
    model = {row["bound_s"]: row for row in estimates["model_based"]}
    out = []
    for row in bounds:
        b = row["bound_s"]
        out.append({**row, "false_alarms": {"direct": direct.get(b), "model_based": model.get(b)}})
    return out


def report(lake_dir: str | Path, **false_alarm_options: Any) -> dict[str, Any]:
    """The grading summary of the lake under ``lake_dir`` (JSON-able)."""
    con = connect(lake_dir)
    try:
        estimates = false_alarms.estimate(con, **false_alarm_options)
        summary: dict[str, Any] = {
            "lake": str(Path(lake_dir).resolve()),
            "files": rows(con, "SELECT count(*) AS n FROM lake_files")[0]["n"],
            "totals": metric(con, "totals"),
            "accuracy": {
                **metric(con, "within_1s"),
                **metric(con, "within_10s"),
                **metric(con, "abs_error_quantiles"),
                **metric(con, "p90_coverage"),
            },
            "underpredictions": metric(con, "underpredictions"),
            "bounds": _per_bound(rows(con, "SELECT * FROM bounds"), estimates),
            "false_alarm_model": {
                "method": estimates["model_method"],
                "fit_rows": estimates["model_fit_rows"],
            },
            "cache_disagreement": rows(con, "SELECT * FROM cache_disagreement")[0],
            "cache_sources": rows(con, "SELECT * FROM cache_sources"),
            **{key: rows(con, f"SELECT * FROM {view}") for key, view in GROUP_VIEWS.items()},
        }
    finally:
        con.close()
    plain: dict[str, Any] = _plain(summary)
    return plain


# --------------------------------------------------------------------------- render


def _pct(value: Any) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _secs(value: Any) -> str:
    return "—" if value is None else f"{value:.2f} s"


def _num(value: Any) -> str:
    if value is None:
        return "—"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.1f}"


def _interval(estimate: Mapping[str, Any] | None, value: str, lo: str, hi: str) -> str:
    if not estimate or estimate.get(value) is None:
        return "—"
    return f"{estimate[value]:,.1f} [{estimate[lo]:,.1f}, {estimate[hi]:,.1f}]"


def _accuracy_table(title: str, keys: Sequence[str], data: list[dict[str, Any]]) -> Table:
    table = Table(title=title, title_justify="left")
    for key in keys:
        table.add_column(key)
    for name in ("requests", "served", "rejected", "graded"):
        table.add_column(name, justify="right")
    for name in ("≤1 s", "≤10 s", "p50 |err|", "p95 |err|", "p99 |err|"):
        table.add_column(name, justify="right")
    table.add_column("same side", justify="right")
    table.add_column("under", justify="right")
    for row in data:
        table.add_row(
            *[str(row[k]) if row[k] is not None else "—" for k in keys],
            *[_num(row[k]) for k in ("requests", "served", "rejected", "graded")],
            _pct(row["within_1s"]),
            _pct(row["within_10s"]),
            *[_secs(row[f"abs_error_p{q}_s"]) for q in (50, 95, 99)],
            f"{row['same_side']:,}/{row['bounded']:,}",
            _num(row["underpredictions"]),
        )
    return table


def _headline(summary: Mapping[str, Any]) -> Table:
    totals, acc = summary["totals"], summary["accuracy"]
    under = summary["underpredictions"]
    table = Table(title=f"grading — {summary['lake']}", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    lines = [
        ("requests (one per request id)", _num(totals["requests"])),
        ("served / rejected / errors / cancelled / no outcome", "/".join(
            _num(totals[k])
            for k in ("served", "rejected", "errors", "cancelled", "missing_outcome"))),
        ("explore admissions", _num(totals["explore_admitted"])),
        ("files / hours", f"{summary['files']:,} / {totals['hours']:,}"),
        ("graded (served with a prediction)", _num(acc["graded"])),
        ("within 1 s", _pct(acc["within_1s"])),
        ("within 10 s", _pct(acc["within_10s"])),
        ("|error| p50 / p95 / p99", " / ".join(
            _secs(acc[f"abs_error_p{q}_s"]) for q in (50, 95, 99))),
        ("underpredictions", f"{_num(under['underpredictions'])} of "
            f"{_num(under['promised'])} promised ({_pct(under['underprediction_rate'])})"),
        ("same side of the bound", _pct(under["same_side_fraction"])),
        ("actual ≤ predicted p90", f"{_pct(acc['p90_coverage'])} of {_num(acc['graded_p90'])}"),
    ]  # fmt: skip
    for label, value in lines:
        table.add_row(label, value)
    return table


def _bounds_table(summary: Mapping[str, Any]) -> Table:
    table = Table(title="per bound B (PRODUCT.md §4)", title_justify="left")
    for name in ("B", "admitted", "rejected", "explore", "under", "under rate"):
        table.add_column(name, justify="right")
    for name in ("pred≤B act≤B", "pred≤B act>B", "pred>B act≤B", "pred>B act>B"):
        table.add_column(name, justify="right")
    table.add_column("false alarms: explore [95%]", justify="right")
    table.add_column("not explorable", justify="right")  # rejections no delay could turn
    table.add_column("false alarms: model [95%]", justify="right")
    for row in summary["bounds"]:
        fa = row["false_alarms"]
        direct = fa["direct"] or {}
        table.add_row(
            f"{row['bound_s']:g} s",
            _num(row["admitted"]),
            _num(row["rejected"]),
            _num(row["explore_admitted"]),
            _num(row["underpredictions"]),
            _pct(row["underprediction_rate"]),
            _num(row["predicted_within_actual_within"]),
            _num(row["predicted_within_actual_over"]),
            _num(row["predicted_over_actual_within"]),
            _num(row["predicted_over_actual_over"]),
            _interval(fa["direct"], "estimated_false_alarms",
                      "estimated_false_alarms_lo", "estimated_false_alarms_hi"),
            _num(direct.get("rejected_not_explored")),
            _interval(fa["model_based"], "estimated_false_alarms", "lo", "hi"),
        )  # fmt: skip
    return table


def _cache_table(summary: Mapping[str, Any]) -> Table:
    cache = summary["cache_disagreement"]
    table = Table(title="cache disagreement (both sides known)", title_justify="left")
    for name in ("known", "disagreeing", "rate", "≤1 s agreeing", "≤1 s disagreeing"):
        table.add_column(name, justify="right")
    table.add_row(
        _num(cache["known"]),
        _num(cache["disagreeing"]),
        _pct(cache["disagreement_rate"]),
        f"{_pct(cache['within_1s_agreeing'])} of {_num(cache['graded_agreeing'])}",
        f"{_pct(cache['within_1s_disagreeing'])} of {_num(cache['graded_disagreeing'])}",
    )
    return table


def _sources_table(summary: Mapping[str, Any]) -> Table:
    """Per cache source: engines' KV events, or approximate (engines without events)."""
    table = Table(title="per cache source (reuse unknown: the engine did not say)",
                  title_justify="left")  # fmt: skip
    for name in ("source", "served", "reuse known", "reuse unknown", "disagreement", "≤1 s"):
        table.add_column(name, justify="right")
    for row in summary.get("cache_sources", []):
        table.add_row(
            str(row["cache_source"]), _num(row["served"]), _num(row["reuse_known"]),
            _num(row["reuse_unknown"]), _pct(row["disagreement_rate"]),
            f"{_pct(row['within_1s'])} of {_num(row['graded'])}",
        )  # fmt: skip
    return table


def render(summary: Mapping[str, Any], console: Console) -> None:
    """Print a :func:`report` summary as rich tables."""
    hours = summary["by_hour"]
    title = "per hour" if len(hours) <= RENDERED_HOURS else f"per hour (last {RENDERED_HOURS})"
    for table in (
        _headline(summary),
        _bounds_table(summary),
        _cache_table(summary),
        _sources_table(summary),
        _accuracy_table("per model", ["model"], summary["by_model"]),
        _accuracy_table("per worker", ["model", "worker_id"], summary["by_worker"]),
        _accuracy_table("per workload class", ["workload_class"], summary["by_class"]),
        _accuracy_table(title, ["hour"], hours[-RENDERED_HOURS:]),
    ):
        print_table(console, table)


# --------------------------------------------------------------------------- shell


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    return f"{value:.{SHELL_DIGITS}g}" if isinstance(value, float) else str(value)


def frame_table(frame: pl.DataFrame, max_rows: int = SHELL_MAX_ROWS) -> Table:
    """A polars frame as a rich table (its first ``max_rows`` rows)."""
    table = Table(caption=f"{frame.height:,} rows" + (
        f" (first {max_rows:,} shown)" if frame.height > max_rows else ""))  # fmt: skip
    for name, dtype in frame.schema.items():
        numeric = dtype.is_numeric()  # fold long values onto more lines, never elide them
        table.add_column(name, justify="right" if numeric else "left", overflow="fold")
    for row in frame.head(max_rows).iter_rows():
        table.add_row(*[_cell(v) for v in row])
    return table


def _run(con: duckdb.DuckDBPyConnection, sql: str, console: Console) -> bool:
    try:
        frame = query(con, sql)
    except duckdb.Error as exc:
        console.print(f"[red]{type(exc).__name__}: {exc}[/red]")
        return False
    print_table(console, frame_table(frame))
    return True


def sql_shell(
    lake_dir: str | Path,
    sql: str | None = None,
    *,
    console: Console | None = None,
    read_line: Callable[[str], str] = input,
) -> int:
    """Run ``sql`` on the lake's views and print it; without ``sql``, read queries one
    line at a time until ``.quit`` (or end of input); ``.views`` lists the views.
    Returns 0, or 1 when the one query failed (an exit status for the CLI)."""
    out = console or output_console()
    con = connect(lake_dir)
    try:
        if sql is not None:
            return 0 if _run(con, sql, out) else 1
        out.print(f"views: {', '.join(view_names())} — .quit to leave")
        while True:
            try:
                line = read_line(PROMPT).strip()
            except EOFError:
                return 0
            if line in QUIT:
                return 0
            if line == ".views":
                out.print(", ".join(view_names()))
            elif line:
                _run(con, line.removesuffix(";"), out)
    finally:
        con.close()
