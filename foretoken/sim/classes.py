"""Workload classes in a replay (issue #8): a class mix over a trace, per-class results,
and the latency controls' events next to the lake.

* :class:`ClassMix` (``"interactive:0.3,batch:0.7"``) gives each class exactly its share of
  the requests in a seeded random order, and each request its class's default
  ``max_queue_wait_s`` when it has none — so a replay with the controls on and one with
  them off see the same requests with the same bounds.
* :func:`class_summary`: per class, counts, TTFT tails of served requests and **goodput**:
  requests served within the class's TTFT objective (and within their bound, if any), as
  a count and as a share of all the class's requests (rejections count against it).
* :func:`write_control_events`: the controls' stage changes as Parquet under
  ``OUT/controls/`` (write then rename), for the dashboard.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import polars as pl

from foretoken.core.types import ControlChange
from foretoken.settings import ControlSettings
from foretoken.sim.traces import TraceRequest
from foretoken.wire.records import Graded

CONTROLS_DIR = "controls"
PERCENTILES = (50.0, 95.0, 99.0)


@dataclass(frozen=True, slots=True)
class ClassMix:
    names: tuple[str, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.names or len(self.names) != len(self.weights):
            raise ValueError("a class mix needs one weight per class and at least one class")
        if len(set(self.names)) != len(self.names):
            raise ValueError("a class appears twice in the mix")
        if any(not (w >= 0 and math.isfinite(w)) for w in self.weights):
            raise ValueError("class weights must be non-negative")
        if abs(sum(self.weights) - 1.0) > 1e-6:
            raise ValueError(f"class weights must sum to 1, got {sum(self.weights)}")

    @classmethod
    def parse(cls, text: str) -> ClassMix:
        names: list[str] = []
        weights: list[float] = []
        for item in text.split(","):
            name, sep, weight = item.strip().partition(":")
            if not sep or not name.strip():
                raise ValueError(f"class mix item {item!r} is not CLASS:WEIGHT")
            try:
                weights.append(float(weight))
            except ValueError as exc:
                raise ValueError(f"class mix item {item!r}: {exc}") from exc
            names.append(name.strip())
        return cls(tuple(names), tuple(weights))

    def assign(
        self, requests: Sequence[TraceRequest], controls: ControlSettings, seed: int = 0
    ) -> list[TraceRequest]:
        unknown = [n for n in self.names if n not in controls.classes]
        if unknown:
            raise ValueError(
                f"unknown workload class(es) {unknown}; configured: "
                f"{sorted(controls.classes)} (classes come from --config)"
            )
        n = len(requests)
        quotas = np.asarray(self.weights) * n
        counts = np.floor(quotas).astype(np.int64)
        counts[np.argsort(-(quotas - counts), kind="stable")[: n - int(counts.sum())]] += 1
        labels = np.repeat(np.arange(len(self.names)), counts)
        labels = labels[np.random.default_rng(seed + 1).permutation(n)]
        out = []
        for request, label in zip(requests, labels, strict=True):
            name = self.names[int(label)]
            bound = request.max_queue_wait_s
            if bound is None:
                bound = controls.classes[name].max_queue_wait_s
            out.append(request.with_class(name).with_bound(bound))
        return out


def class_summary(records: Sequence[Graded], controls: ControlSettings) -> dict[str, Any]:
    """Per workload class: requests, served, rejected (by admission control among them),
    TTFT p50/p95/p99 of served requests, goodput (within the class objective and bound)."""
    out: dict[str, Any] = {}
    for name in sorted({r.workload_class for r in records}):
        mine = [r for r in records if r.workload_class == name]
        _, klass = controls.workload_class(name)
        served = [r for r in mine if r.status == "served" and r.actual_ttft_s is not None]
        ttft = np.asarray([r.actual_ttft_s for r in served], dtype=np.float64)
        tails = np.percentile(ttft, PERCENTILES).tolist() if len(ttft) else [None] * 3

        goodput = sum(_within(r, klass.objective_ttft_s) for r in served)
        out[name] = {
            "objective_ttft_s": klass.objective_ttft_s,
            "percentile": klass.percentile,
            "requests": len(mine),
            "served": len(served),
            "rejected": sum(r.status == "rejected" for r in mine),
            "ttft_p50_s": tails[0],
            "ttft_p95_s": tails[1],
            "ttft_p99_s": tails[2],
            "ttft_at_objective_percentile_s": (
                float(np.percentile(ttft, klass.percentile)) if len(ttft) else None
            ),
            "goodput": goodput,
            "goodput_fraction": goodput / len(mine) if mine else None,
        }
    return out


def _within(record: Graded, objective_s: float) -> bool:
    """Served within the class's objective and within the request's bound (if any)."""
    t, bound = record.actual_ttft_s, record.max_queue_wait_s
    return t is not None and t <= objective_s and (bound is None or t <= bound)


def control_events_frame(events: Sequence[ControlChange]) -> pl.DataFrame:
    rows = []
    for e in events:
        row = msgspec.to_builtins(e)
        signals = row.pop("signals")
        row.update({f"signal_{k}": v for k, v in signals.items()})
        rows.append(row)
    return pl.DataFrame(rows, infer_schema_length=None)


def write_control_events(events: Sequence[ControlChange], out_dir: str | Path) -> Path | None:
    """The events as one Parquet file under ``OUT/controls/`` (write then rename)."""
    if not events:
        return None
    folder = Path(out_dir) / CONTROLS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"part-{time.time_ns()}.parquet"
    tmp = final.with_suffix(".tmp")
    control_events_frame(events).write_parquet(tmp)
    os.replace(tmp, final)
    return final
