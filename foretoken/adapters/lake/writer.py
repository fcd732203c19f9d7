"""The grading lake: the one writer of graded records to hour-partitioned Parquet.

Layout (read by the DuckDB views in ``sql/``, see :mod:`foretoken.adapters.lake.views`)::

    LAKE/graded/hour=YYYY-MM-DDTHH/part-<seq>-<uuid>.parquet

* **Columns** = the :class:`~foretoken.wire.records.Graded` fields, typed from the Struct itself
  (:func:`graded_schema`, the one place the lake schema is defined); the ``hour`` column
  comes from the path (the UTC hour of ``ts``, the grant's time).
* **Write then rename.** A file is written under a hidden ``.part-….parquet.tmp`` name,
  flushed to disk and renamed; a rename is atomic, so a reader's glob sees a whole file
  or none, never a partial one. Files are never rewritten in place.
* **Write order.** ``<seq>`` is the writer's clock in nanoseconds (20 digits, strictly
  increasing within a process; across processes, the wall clock at the start of the
  write), so within an hour directory the file names sort in the order they were written;
  "the latest written" row of a request is the one in the file whose name sorts last.

**LZ4.** Files are LZ4-compressed (:data:`COMPRESSION`): the graded floats barely
compress, and LZ4 decodes with less CPU than polars' default zstd on every scan.

**Who compacts.** The worker's sink (``streams/lake_sink.py``) calls
:meth:`LakeWriter.compact_closed` periodically: hours closed for a while
(:func:`closed_hours`) are merged into one file each.

**Served-only grades.** ``actual_ttft_s`` and ``error_s`` are kept on served rows only
(the grading join never sets them otherwise; :func:`served_only_grades` makes it a
property of the lake), so the views grade "over served requests" by a null test.

**Idempotency.** Records are delivered at least once, so a request id may arrive again.

1. :meth:`LakeWriter.append` keeps one record per request id within a batch (the last
   one), so every file holds distinct request ids.
2. The *read* side dedupes by request id: the ``graded`` view keeps, per request id, the
   row of the file that sorts last. A re-delivery written into a later file is therefore
   harmless: it replaces the earlier row, it never adds one. A re-delivered record keeps
   its ``ts`` (the grant's), hence its hour, so duplicates only ever share an hour
   directory; an hour with a single file has nothing to dedupe (that is what keeps the
   views fast on a compacted lake).
3. :meth:`LakeWriter.compact` removes the duplicates physically.

**Compaction** (:meth:`LakeWriter.compact`) merges the files of an hour into one, keeping
the latest row per request id: (1) read the hour's files, (2) write the merged file under
a temporary name and rename it into place, named with the *largest* sequence of its
inputs (so it still sorts before anything written after those inputs), (3) only then
delete the inputs. The writer never waits for it (appends make new files with new
names). A reader that lists the directory at any moment sees either the old files, the
old files plus the merged one, or the merged one plus the not yet deleted old ones — in
every case each request's row at least once and, after the read-side dedupe, exactly
once: no gap (the merged file is visible before any input disappears) and no double
count. The one visible effect of a race is that a query which listed an input that is
deleted before it is opened fails with an I/O error and is simply run again
(:func:`foretoken.adapters.lake.views.query` retries).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

import msgspec
import polars as pl

from foretoken.core.types import GradedRequest
from foretoken.wire.records import Graded, as_record

LAKE_TABLE: Final = "graded"
HOUR_PARTITION: Final = "hour"
HOUR_FORMAT: Final = "%Y-%m-%dT%H"
PART_PREFIX: Final = "part-"
PART_SUFFIX: Final = ".parquet"
PART_GLOB: Final = f"{PART_PREFIX}*{PART_SUFFIX}"  # hidden ``.part-….tmp`` files never match
TMP_SUFFIX: Final = ".tmp"
SEQ_DIGITS: Final = 20
US_PER_S: Final = 1_000_000
HOUR_S: Final = 3600.0
# LZ4, not polars' default zstd: graded floats barely compress (files ~20% larger), and
# decoding LZ4 takes about a third less CPU per scan (docs/BENCHMARKS.md, grading lake).
COMPRESSION: Final = "lz4"
STALE_TMP_S: Final = 3600.0  # a temporary file this old belongs to a writer that died
KEY: Final = "request_id"
SERVED: Final = "served"
SERVED_ONLY: Final = ("actual_ttft_s", "error_s")  # TTFT grades exist for served requests

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- schema


def _polars_type(info: msgspec.inspect.Type) -> pl.DataType:
    if isinstance(info, msgspec.inspect.UnionType):
        (inner,) = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
        return _polars_type(inner)
    if isinstance(info, msgspec.inspect.BoolType):
        return pl.Boolean()
    if isinstance(info, msgspec.inspect.IntType):
        return pl.Int64()
    if isinstance(info, msgspec.inspect.FloatType):
        return pl.Float64()
    if isinstance(
        info, msgspec.inspect.StrType | msgspec.inspect.LiteralType | msgspec.inspect.EnumType
    ):
        return pl.String()
    raise TypeError(f"no lake column type for {info!r}")


def graded_schema() -> dict[str, pl.DataType]:
    """The lake's columns: every ``Graded`` field, typed (stable when a column is all null),
    ``schema_version`` first as the lake has always had it."""
    info = msgspec.inspect.type_info(Graded)
    assert isinstance(info, msgspec.inspect.StructType)
    columns = {f.name: _polars_type(f.type) for f in info.fields}
    return {"schema_version": columns.pop("schema_version"), **columns}


def graded_frame(records: Sequence[GradedRequest]) -> pl.DataFrame:
    """Graded requests as lake rows (a core value is written as the wire record it is)."""
    rows = msgspec.to_builtins([as_record(Graded, r) for r in records])
    return pl.DataFrame(rows, schema=graded_schema(), orient="row")


def hour_of(ts: pl.Expr) -> pl.Expr:
    """The partition value (UTC hour, ``HOUR_FORMAT``) of a Unix-seconds column."""
    return (
        pl.from_epoch((ts * US_PER_S).cast(pl.Int64), time_unit="us")
        .dt.strftime(HOUR_FORMAT)
        .alias(HOUR_PARTITION)
    )


def conform(frame: pl.DataFrame) -> pl.DataFrame:
    """``frame`` with exactly the lake's columns, in order and typed; columns missing from
    an older file come back as nulls, unknown columns are an error."""
    schema = graded_schema()
    unknown = [c for c in frame.columns if c not in schema]
    if unknown:
        raise ValueError(f"columns {unknown} are not Graded fields")
    return frame.select(
        pl.col(name).cast(dtype) if name in frame.columns else pl.lit(None, dtype).alias(name)
        for name, dtype in schema.items()
    )


def served_only_grades(frame: pl.DataFrame) -> pl.DataFrame:
    """``actual_ttft_s`` and ``error_s`` kept on served rows only (what the grading join
    produces anyway), so that the views can read "served" off a non-null error."""
    served = pl.col("status") == SERVED
    return frame.with_columns(
        pl.when(served).then(pl.col(name)).otherwise(None).alias(name) for name in SERVED_ONLY
    )


def latest_per_request(frame: pl.DataFrame) -> pl.DataFrame:
    """One row per request id: the last one in ``frame``'s order (= the latest written)."""
    return frame.unique(subset=[KEY], keep="last", maintain_order=True)


# --------------------------------------------------------------------------- files


def part_sequence(path: Path) -> str:
    """The write-order key in a part file's name (``""`` for a name without one)."""
    stem = path.name.removeprefix(PART_PREFIX).removesuffix(PART_SUFFIX)
    seq, _, _ = stem.partition("-")
    return seq if len(seq) == SEQ_DIGITS and seq.isdigit() else ""


def hour_dirs(root: str | Path) -> dict[str, Path]:
    """Hour value → its directory, for every partition of the lake under ``root``."""
    table = Path(root) / LAKE_TABLE
    prefix = f"{HOUR_PARTITION}="
    if not table.is_dir():
        return {}
    return {
        d.name.removeprefix(prefix): d
        for d in sorted(table.iterdir())
        if d.is_dir() and d.name.startswith(prefix)
    }


def hour_start_s(hour: str) -> float:
    """The Unix time at which the partition ``hour`` (``HOUR_FORMAT``, UTC) begins."""
    return datetime.strptime(hour, HOUR_FORMAT).replace(tzinfo=UTC).timestamp()


def closed_hours(hours: Iterable[str], now_s: float, after_s: float) -> list[str]:
    """The hours that ended at least ``after_s`` before ``now_s`` (unparsable names are
    skipped): no new record is expected there but a late or re-delivered one."""
    out = []
    for hour in hours:
        try:
            end_s = hour_start_s(hour) + HOUR_S
        except ValueError:
            continue
        if end_s + after_s <= now_s:
            out.append(hour)
    return out


def part_files(directory: Path) -> list[Path]:
    """The visible part files of one hour directory, in write order."""
    return sorted(directory.glob(PART_GLOB), key=lambda p: (part_sequence(p), p.name))


def _fsync(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


@dataclass(frozen=True, slots=True)
class Compacted:
    """What one hour's compaction did."""

    hour: str
    merged_files: int
    rows_in: int
    rows_out: int
    path: Path


class _Sequence:
    """Strictly increasing nanosecond stamps for file names (process-wide)."""

    _lock = threading.Lock()
    _last = 0

    @classmethod
    def next(cls) -> int:
        with cls._lock:
            cls._last = max(cls._last + 1, time.time_ns())
            return cls._last


# --------------------------------------------------------------------------- writer


class LakeWriter:
    """Appends graded records to the lake under ``root`` and compacts its hours.

    Safe to use from several processes at once (every file has a unique name); compaction
    of one hour should run in one place at a time (two at once stay correct — the second
    finds its inputs gone and leaves the hour to the first)."""

    def __init__(self, root: str | Path, *, durable: bool = True) -> None:
        self.root = Path(root)
        self.table = self.root / LAKE_TABLE
        self.durable = durable

    # ------------------------------------------------------------------ append

    def append(self, records: Sequence[GradedRequest]) -> list[Path]:
        """Write ``records`` (one file per hour touched); a request id repeated in the batch
        keeps its last record. Returns the files written."""
        if not records:
            return []
        bad = next((r for r in records if not math.isfinite(r.ts)), None)
        if bad is not None:  # its hour partition is undefined: refuse the batch, say why
            raise ValueError(f"graded request {bad.request_id}: ts must be finite, got {bad.ts}")
        return self.append_frame(graded_frame(records))

    def append_frame(self, frame: pl.DataFrame) -> list[Path]:
        """:meth:`append` for a frame with the ``Graded`` columns (vectorized producers)."""
        frame = served_only_grades(latest_per_request(conform(frame)))
        if frame.is_empty():
            return []
        with_hour = frame.with_columns(hour_of(pl.col("ts")))
        written: list[Path] = []
        for (hour,), part in with_hour.group_by(HOUR_PARTITION, maintain_order=True):
            written.append(self._write(str(hour), part.drop(HOUR_PARTITION), _Sequence.next()))
        return written

    def _write(self, hour: str, frame: pl.DataFrame, seq: int) -> Path:
        directory = self.table / f"{HOUR_PARTITION}={hour}"
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / f"{PART_PREFIX}{seq:0{SEQ_DIGITS}d}-{uuid.uuid4().hex}{PART_SUFFIX}"
        temporary = directory / f".{target.name}{TMP_SUFFIX}"
        try:
            frame.write_parquet(temporary, compression=COMPRESSION)
            if self.durable:
                _fsync(temporary)
            temporary.rename(target)
        finally:
            temporary.unlink(missing_ok=True)
        return target

    # ------------------------------------------------------------------ compact

    def compact(self, hour: str | None = None) -> list[Compacted]:
        """Merge the files of ``hour`` (default: every hour with more than one file) into
        one file each, latest row per request id (ordering guarantee: module docstring)."""
        dirs = hour_dirs(self.root)
        if hour is not None:
            dirs = {hour: dirs[hour]} if hour in dirs else {}
        done: list[Compacted] = []
        for name, directory in dirs.items():
            self._remove_stale_tmp(directory)
            try:
                result = self._compact_hour(name, directory)
            except Exception as exc:  # one hour that cannot be merged never blocks the others
                log.warning("lake hour %s not compacted: %s", name, exc)
                continue
            if result is not None:
                done.append(result)
        return done

    def compact_closed(self, now_s: float, after_s: float) -> list[Compacted]:
        """:meth:`compact` of every hour closed for ``after_s`` (:func:`closed_hours`) that
        holds more than one file; the open hours keep taking appends untouched."""
        done: list[Compacted] = []
        for hour in closed_hours(hour_dirs(self.root), now_s, after_s):
            done.extend(self.compact(hour))
        return done

    def _compact_hour(self, hour: str, directory: Path) -> Compacted | None:
        inputs, frames = [], []
        for path in part_files(directory):
            try:
                raw = pl.read_parquet(path)
            except FileNotFoundError:
                return None  # another compaction of this hour got there first
            except (OSError, pl.exceptions.PolarsError) as exc:
                log.warning("lake file %s is not readable Parquet, left as it is: %s", path, exc)
                continue
            unknown = sorted(set(raw.columns) - graded_schema().keys())
            if KEY not in raw.columns or unknown:  # a foreign file (the views skip it), or
                log.warning(  # a newer writer's: never dropped, never merged into ours
                    "lake file %s left as it is: %s", path,
                    f"columns {unknown} are not Graded fields" if unknown else "no request_id",
                )  # fmt: skip
                continue
            inputs.append(path)
            frames.append(conform(raw))
        if len(inputs) < 2:
            return None
        merged = pl.concat(frames, how="vertical")
        latest = latest_per_request(merged)
        seqs = [int(s) for s in map(part_sequence, inputs) if s]
        target = self._write(hour, latest, max(seqs) if seqs else _Sequence.next())
        for path in inputs:
            path.unlink(missing_ok=True)
        return Compacted(hour, len(inputs), merged.height, latest.height, target)

    def _remove_stale_tmp(self, directory: Path) -> None:
        cutoff = time.time() - STALE_TMP_S
        for path in directory.glob(f".*{TMP_SUFFIX}"):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink(missing_ok=True)
            except FileNotFoundError:
                continue


def write_lake(records: Sequence[GradedRequest], out_dir: str | Path) -> list[Path]:
    """Append ``records`` to the lake under ``out_dir``; returns the files written."""
    return LakeWriter(out_dir).append(records)
