"""Arrivals and lengths from a CSV request trace, whoever wrote it (PRODUCT.md §3).

The Azure LLM inference traces (2023 and 2024: ``TIMESTAMP``, ``ContextTokens``,
``GeneratedTokens``) are the shipped kind; other public traces carry the same three facts
under other names — BurstGPT (``Timestamp`` in seconds, ``Request tokens``, ``Response
tokens``), exports with ``timestamp`` / ``input_length`` / ``output_length`` or
``prompt_tokens`` / ``completion_tokens``. Columns are matched by name, case and spaces
aside; a timestamp is a date-time string (Azure's exact format first, then any ISO-8601
form, with or without a zone) or a number of seconds (``…_ms`` columns: milliseconds),
relative or since the epoch. A row whose prompt or output is 0 tokens is a request that
never produced a first token (BurstGPT logs failures with 0 response tokens): it is left
out, and counted; blank lines are skipped. An empty cell, a negative or fractional token
count, and anything else that cannot be read, is a one-line :class:`TraceFormatError`
naming the file and line. Every cell is read as text and converted here, so a column whose
form changes deep in a file (``12`` for 10,000 rows, then ``12.5``) is read all the same.

Pure: polars and numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import polars as pl

from foretoken.core.checks import MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS

AZURE_TIMESTAMP_FORMAT: Final = "%Y-%m-%d %H:%M:%S%.f"
MAX_SPAN_S: Final = 86_400.0 * 366  # a trace longer than a year is a unit mistake
NS_PER_S: Final = 1e9
LINE: Final = "__foretoken_line__"  # a row's line in the file (the header is line 1)
# Accepted names (lower case, spaces and dashes as underscores), best first.
TIME_COLUMNS: Final = ("timestamp", "arrival_time", "arrival_s", "time", "timestamp_ms",
                       "arrival_time_ms", "created_at", "arrival_timestamp")  # fmt: skip
# (arrival_timestamp, prompt_size, token_size: Splitwise's simulator traces)
PROMPT_COLUMNS: Final = ("contexttokens", "context_tokens", "request_tokens", "input_length",
                         "input_tokens", "prompt_tokens", "prompt_length", "isl",
                         "prompt_size")  # fmt: skip
OUTPUT_COLUMNS: Final = ("generatedtokens", "generated_tokens", "response_tokens",
                         "output_length", "output_tokens", "completion_tokens",
                         "output_len", "osl", "token_size")  # fmt: skip


class TraceFormatError(ValueError):
    """A trace file that cannot be read, with the file and line in the message."""


@dataclass(frozen=True, slots=True)
class CsvTrace:
    """A CSV trace's requests in arrival order: seconds from the first, prompt and output
    tokens; ``dropped``: rows left out (no first token: an empty or zero length)."""

    arrivals_s: np.ndarray
    prompts: np.ndarray
    outputs: np.ndarray
    dropped: int


def _norm(name: str) -> str:
    return name.strip().lower().replace(" ", "_").replace("-", "_")


def _column(frame: pl.DataFrame, wanted: tuple[str, ...], what: str, source: Path) -> str:
    by_norm = {_norm(c): c for c in frame.columns}
    for name in wanted:
        if name in by_norm:
            return by_norm[name]
    found = [c for c in frame.columns if c != LINE]
    raise TraceFormatError(f"{source}: no {what} column (one of {', '.join(wanted)}; "
                           f"found {found})")  # fmt: skip


def _first_line(exc: BaseException) -> str:
    """An exception's message on one line (polars explains itself over several)."""
    return next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)


def _read(source: Path, n_rows: int | None) -> tuple[pl.DataFrame, int]:
    """The first ``n_rows`` rows, every cell as text, blank lines dropped; and how many
    rows the file gave (blank ones too: fewer than ``n_rows`` means its end)."""
    try:  # glob=False: a path is one file ('*' or '[1]' in a name is not a pattern)
        frame = pl.read_csv(source, n_rows=n_rows, infer_schema=False, glob=False,
                            row_index_name=LINE, row_index_offset=2)  # fmt: skip
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise TraceFormatError(f"{source}: {_first_line(exc)}") from exc
    cells = [c for c in frame.columns if c != LINE]
    blank = pl.all_horizontal([pl.col(c).is_null() for c in cells]) if cells else pl.lit(False)
    return frame.filter(~blank), frame.height


def _numbers(frame: pl.DataFrame, column: str, source: Path) -> np.ndarray:
    """A column as float64; an empty or unreadable cell is an error naming its line."""
    text = frame[column].str.strip_chars()
    missing = text.is_null()
    if missing.any():  # an empty cell (was: "cannot convert float NaN to integer")
        line = int(frame[LINE][int(missing.arg_true()[0])])
        raise TraceFormatError(f"{source}:{line}: an empty {column} cell")
    values = text.cast(pl.Float64, strict=False)
    bad = values.is_null()
    if bad.any():
        i = int(bad.arg_true()[0])
        raise TraceFormatError(f"{source}:{int(frame[LINE][i])}: {column} {text[i]!r} is not "
                               "a number")  # fmt: skip
    return values.to_numpy()


def _seconds(frame: pl.DataFrame, column: str, source: Path) -> np.ndarray:
    """Trace seconds of every row (absolute or relative: only differences are used)."""
    text = frame[column].str.strip_chars()
    numeric = text.cast(pl.Float64, strict=False)
    if numeric.null_count() == text.null_count():  # every cell a number of seconds
        scale = 1e-3 if _norm(column).endswith("_ms") else 1.0
        return numeric.to_numpy() * scale
    parsed = text.str.to_datetime(AZURE_TIMESTAMP_FORMAT, time_unit="ns", strict=False)
    if parsed.null_count() > text.null_count():  # another form: ISO-8601, maybe zoned
        try:
            parsed = text.str.to_datetime(time_unit="ns", time_zone="UTC", strict=False)
        except pl.exceptions.PolarsError:
            parsed = text.str.to_datetime(time_unit="ns", strict=False)
    bad = parsed.is_null() & text.is_not_null()
    if bad.any():
        i = int(bad.arg_true()[0])
        raise TraceFormatError(f"{source}:{int(frame[LINE][i])}: {column} {text[i]!r} is not "
                               "a time")  # fmt: skip
    ns = parsed.dt.epoch("ns").to_numpy()
    return (ns - ns.min()) / NS_PER_S  # relative first: float64 cannot hold epoch ns


def _requests(frame: pl.DataFrame, prompt_col: str, output_col: str) -> pl.Series:
    """Rows that may be requests: not a failure logged with 0 tokens (an unreadable cell
    counts as a request, so that reading it reports it)."""
    prompt, output = (frame[c].str.strip_chars().cast(pl.Float64, strict=False)
                      for c in (prompt_col, output_col))  # fmt: skip
    return ~((prompt == 0) | (output == 0)).fill_null(False)


def _rows_for(source: Path, limit: int | None, prompt_col: str, output_col: str) -> pl.DataFrame:
    """The file's rows up to its ``limit``-th request (every row without a limit): rows
    logged without a first token do not count, so the file is read on until enough."""
    n_rows = limit
    while True:
        frame, height = _read(source, n_rows)
        if limit is None or not frame.height:
            return frame
        counted = _requests(frame, prompt_col, output_col).cum_sum()
        if int(counted[-1]) >= limit:
            return frame.head(int((counted >= limit).arg_true()[0]) + 1)
        if n_rows is None or height < n_rows:  # the whole file: fewer requests than asked
            return frame
        n_rows *= 2


def read_csv_trace(source: Path, limit: int | None = None) -> CsvTrace:
    """The requests of a CSV trace (module doc), sorted by arrival; ``limit`` keeps the
    first N requests of the file (rows without a first token are left out, not counted)."""
    if source.is_dir():
        raise TraceFormatError(f"{source}: is a directory, not a trace file")
    header, _ = _read(source, 0)
    time_col = _column(header, TIME_COLUMNS, "arrival time", source)
    prompt_col = _column(header, PROMPT_COLUMNS, "prompt tokens", source)
    output_col = _column(header, OUTPUT_COLUMNS, "output tokens", source)
    frame = _rows_for(source, limit, prompt_col, output_col)
    if frame.height == 0:
        return CsvTrace(np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64), 0)
    missing = frame[time_col].is_null()
    if missing.any():
        line = int(frame[LINE][int(missing.arg_true()[0])])
        raise TraceFormatError(f"{source}:{line}: an empty {time_col} cell")
    prompts = _numbers(frame, prompt_col, source)
    outputs = _numbers(frame, output_col, source)
    stamps = _seconds(frame, time_col, source)
    lines = frame[LINE].to_numpy()
    for column, values, top in ((prompt_col, prompts, MAX_PROMPT_TOKENS),
                                (output_col, outputs, MAX_OUTPUT_TOKENS)):  # fmt: skip
        bad = ~np.isfinite(values)
        bad |= (np.abs(values) > top) | (values < 0) | (values != np.round(values))
        if bad.any():
            i = int(np.argmax(bad))
            what = "finite" if not np.isfinite(values[i]) else "a whole number of tokens"
            raise TraceFormatError(f"{source}:{int(lines[i])}: {column} {values[i]:g} is not "
                                   f"{what} from 0 to {int(top)}")  # fmt: skip
    bad = ~np.isfinite(stamps)
    if bad.any():
        i = int(np.argmax(bad))
        raise TraceFormatError(f"{source}:{int(lines[i])}: {time_col} {float(stamps[i])} is "
                               "not finite")  # fmt: skip
    stamps = stamps - stamps.min()  # epoch or trace seconds: only differences are used
    if float(stamps.max()) > MAX_SPAN_S:
        raise TraceFormatError(f"{source}: its times span more than {MAX_SPAN_S:g} s")
    keep = (prompts >= 1) & (outputs >= 1)
    order = np.argsort(stamps[keep], kind="stable")
    kept = stamps[keep][order]
    return CsvTrace(
        arrivals_s=kept - kept[0] if kept.size else kept,
        prompts=prompts[keep][order].astype(np.int64),
        outputs=outputs[keep][order].astype(np.int64),
        dropped=int(frame.height - keep.sum()),
    )
