"""Arrivals and lengths from a CSV request trace, whoever wrote it (PRODUCT.md §3).

The Azure LLM inference traces (2023 and 2024: ``TIMESTAMP``, ``ContextTokens``,
``GeneratedTokens``) are the shipped kind; other public traces carry the same three facts
under other names — BurstGPT (``Timestamp`` in seconds, ``Request tokens``, ``Response
tokens``), exports with ``timestamp`` / ``input_length`` / ``output_length`` or
``prompt_tokens`` / ``completion_tokens``. Columns are matched by name, case and spaces
aside; a timestamp is a date-time string (Azure's exact format first, then any ISO-8601
form, with or without a zone) or a number of seconds (``…_ms`` columns: milliseconds).
A row whose prompt or output is below one token is a request that never produced a first
token (BurstGPT logs failures with 0 response tokens): it is left out, and counted. An
empty cell, and anything else that cannot be read, is a :class:`TraceFormatError` naming
the file and line.

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
# Accepted names (lower case, spaces and dashes as underscores), best first.
TIME_COLUMNS: Final = ("timestamp", "arrival_time", "arrival_s", "time", "timestamp_ms",
                       "arrival_time_ms", "created_at")  # fmt: skip
PROMPT_COLUMNS: Final = ("contexttokens", "context_tokens", "request_tokens", "input_length",
                         "input_tokens", "prompt_tokens", "prompt_length", "isl")  # fmt: skip
OUTPUT_COLUMNS: Final = ("generatedtokens", "generated_tokens", "response_tokens",
                         "output_length", "output_tokens", "completion_tokens",
                         "output_len", "osl")  # fmt: skip


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
    raise TraceFormatError(
        f"{source}: no {what} column (one of {', '.join(wanted)}; found {frame.columns})"
    )


def _seconds(frame: pl.DataFrame, column: str, source: Path) -> np.ndarray:
    """Trace seconds of every row (absolute or relative: only differences are used)."""
    series = frame[column]
    if series.dtype.is_numeric():
        scale = 1e-3 if _norm(column).endswith("_ms") else 1.0
        return series.cast(pl.Float64).to_numpy() * scale
    if series.dtype != pl.String:
        series = series.cast(pl.String)
    text = series.str.strip_chars()
    parsed = text.str.to_datetime(AZURE_TIMESTAMP_FORMAT, time_unit="ns", strict=False)
    if parsed.null_count() > text.null_count():  # another form: ISO-8601, maybe zoned
        try:
            parsed = text.str.to_datetime(time_unit="ns", time_zone="UTC", strict=False)
        except pl.exceptions.PolarsError:
            parsed = text.str.to_datetime(time_unit="ns", strict=False)
    bad = parsed.is_null() & text.is_not_null()
    if bad.any():
        line = int(bad.arg_true()[0]) + 2  # the header is line 1
        raise TraceFormatError(f"{source}:{line}: {column} {text[line - 2]!r} is not a time")
    ns = parsed.dt.epoch("ns").to_numpy()
    return (ns - ns.min()) / NS_PER_S  # relative first: float64 cannot hold epoch ns


def read_csv_trace(source: Path, limit: int | None = None) -> CsvTrace:
    """The requests of a CSV trace (module doc), sorted by arrival; ``limit`` keeps the
    first N rows of the file."""
    if source.is_dir():
        raise TraceFormatError(f"{source}: is a directory, not a trace file")
    try:  # glob=False: a path is one file ('*' or '[1]' in a name is not a pattern)
        frame = pl.read_csv(source, n_rows=limit, infer_schema_length=10_000, glob=False)
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise TraceFormatError(f"{source}: {exc}") from exc
    time_col = _column(frame, TIME_COLUMNS, "arrival time", source)
    if frame.height == 0:
        return CsvTrace(np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64), 0)
    prompt_col = _column(frame, PROMPT_COLUMNS, "prompt tokens", source)
    output_col = _column(frame, OUTPUT_COLUMNS, "output tokens", source)
    for column in (time_col, prompt_col, output_col):
        missing = frame[column].is_null()
        if missing.any():  # an empty cell (was: "cannot convert float NaN to integer")
            line = int(missing.arg_true()[0]) + 2  # the header is line 1
            raise TraceFormatError(f"{source}:{line}: an empty {column} cell")
    lengths = {}
    for what, column in (("prompt", prompt_col), ("output", output_col)):
        try:
            lengths[what] = frame[column].cast(pl.Float64).to_numpy()
        except pl.exceptions.PolarsError as exc:
            raise TraceFormatError(f"{source}: {column} must be numbers: {exc}") from exc
    stamps = _seconds(frame, time_col, source)
    prompts, outputs = lengths["prompt"], lengths["output"]
    for column, values, top in ((time_col, stamps, MAX_SPAN_S),
                                (prompt_col, prompts, MAX_PROMPT_TOKENS),
                                (output_col, outputs, MAX_OUTPUT_TOKENS)):  # fmt: skip
        bad = ~np.isfinite(values) | (np.abs(values) > top)
        if bad.any():
            line = int(np.argmax(bad)) + 2
            raise TraceFormatError(f"{source}:{line}: {column} {float(values[line - 2])} is not "
                                   f"finite or past {top:g}")  # fmt: skip
    if float(stamps.max() - stamps.min()) > MAX_SPAN_S:
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
