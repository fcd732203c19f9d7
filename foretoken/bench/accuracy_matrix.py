"""`foretoken bench predict --trace T --fleet F` and `--matrix`: the accuracy matrix of
issue 15 (cells: :mod:`foretoken.bench.accuracy`), its JSON and its table.

JSON (stable; ``schema`` names the version)::

    {"schema": "foretoken.bench.predict/1",
     "cells": [{"trace", "fleet", "load", "policy", "routing", "within_1s", "within_10s",
                "abs_error_p50_s", "abs_error_p95_s", "abs_error_p99_s",
                "under_5s", "under_10s", "under_30s", "p90_coverage", "disagreement",
                "samples", "refused", "rejected"}, ...],
     "summary": {flat numbers: cells, cells_predictor_ge_best_baseline_1s, ...},
     "runs": {per (trace, fleet) preparation and per cell: speedup, wall time, ...}}

One row per (trace, fleet, load, policy). ``under_Bs``: served requests predicted within
B seconds that took longer; ``samples``: served requests graded; ``refused``: requests no
engine of the fleet could hold, left out before the replay; ``rejected``: requests the
routing predictor turned away (none without bounds). A "cell" of the summary is one
(trace, fleet, load); "best baseline" is the best of ``mooncake``, ``linear_rate``,
``request_count`` in that cell. The (trace, fleet) preparations and then the cells run in
``jobs`` parallel processes. ``routing`` is the policy that routed the cell: ``predictor``
(the cold predictor, the default), or the baseline routing given with ``--routing``
(:mod:`foretoken.bench.accuracy`: the predictor then predicts as a read replica, graded on
requests routed independently of its code; no ``predictor_profiled`` row).
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from typing import Any

from foretoken.bench.accuracy import CALIBRATION_RANGE, SCHEMA, Prepared, prepare, run_cell
from foretoken.bench.predict_bench import BASELINES, PROFILED

TRACES = ("mooncake", "azure-code", "azure-conv", "poisson-long", "bursty", "shared-system",
          "mix-1k-200k", "decode-heavy")  # fmt: skip
FLEETS = ("hetero", "small", "random-1", "random-2")
QUICK_FLEETS = ("hetero", "small", "random-1")
LOADS = (0.8, 1.0, 1.3)
UNDER = ("5", "10", "30")


@dataclass(frozen=True, slots=True)
class Sizes:
    limit: int
    calibration_steps: int
    profile_requests: int


QUICK = Sizes(limit=400, calibration_steps=5, profile_requests=80)
FULL = Sizes(limit=1500, calibration_steps=6, profile_requests=240)
SINGLE = Sizes(limit=500, calibration_steps=5, profile_requests=160)


def _prepare(args: tuple[str, str, int | None, int, Sizes, str]) -> Prepared:
    trace, fleet, limit, seed, sizes, max_tokens = args
    return prepare(trace, fleet, limit, seed, calibration_steps=sizes.calibration_steps,
                   profile_requests=sizes.profile_requests, max_tokens=max_tokens)  # fmt: skip


def _cell(args: tuple[Prepared, float, str | None]) -> dict[str, Any]:
    return run_cell(*args)


def run_grid(pairs: Sequence[tuple[str, str]], loads: Sequence[float], sizes: Sizes, *,
             limit: int | None, seed: int, jobs: int, routing: str | None = None,
             max_tokens: str = "exact") -> dict[str, Any]:  # fmt: skip
    """Every (trace, fleet) of ``pairs`` at every load, in ``jobs`` processes: each pair's
    cells start as soon as its preparation is done. ``routing``: a baseline routing
    policy instead of the predictor (:func:`foretoken.bench.accuracy.run_cell`);
    ``max_tokens``: what the clients send (:class:`foretoken.sim.clients.MaxTokensModel`)."""
    started, cpu0 = time.perf_counter(), _cpu_s()
    if jobs <= 1:
        preps = [_prepare((t, f, limit, seed, sizes, max_tokens)) for t, f in pairs]
        cells = [_cell((p, load, routing)) for p in preps for load in loads]
    else:
        preps, cells = _in_pool(pairs, loads, sizes, limit, seed, jobs, routing, max_tokens)
    order = {(t, f): i for i, (t, f) in enumerate(pairs)}
    cells.sort(key=lambda c: (order[(c["meta"]["trace"], c["meta"]["fleet"])], c["meta"]["load"]))
    rows = [row for cell in cells for row in cell["rows"]]
    wall_s, cpu_s = time.perf_counter() - started, _cpu_s() - cpu0
    return {
        "schema": SCHEMA,
        "cells": rows,
        "summary": summarize(rows) | {"wall_s": round(wall_s, 1), "cpu_s": round(cpu_s, 1),
                                      "jobs": jobs, "load_average_1m": os.getloadavg()[0],
                                      "routing": routing or "predictor",
                                      "max_tokens": max_tokens},
        "runs": {"prepared": [_prep_meta(p, sizes) for p in preps],
                 "cells": [c["meta"] for c in cells], "sizes": asdict(sizes)},
    }  # fmt: skip


def _in_pool(
    pairs: Sequence[tuple[str, str]], loads: Sequence[float], sizes: Sizes,
    limit: int | None, seed: int, jobs: int, routing: str | None = None,
    max_tokens: str = "exact",
) -> tuple[list[Prepared], list[dict]]:  # fmt: skip
    preps: list[Prepared] = []
    cells: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        pending: dict[Future[Any], str] = {
            pool.submit(_prepare, (t, f, limit, seed, sizes, max_tokens)): "prep" for t, f in pairs
        }
        while pending:
            for done in as_completed(list(pending)):
                kind = pending.pop(done)
                if kind == "prep":
                    prep = done.result()
                    preps.append(prep)
                    pending |= {pool.submit(_cell, (prep, load, routing)): "cell"
                                for load in loads}  # fmt: skip
                    break  # re-enter as_completed with the new futures
                cells.append(done.result())
    return preps, cells


def _cap(sizes: Sizes) -> float:
    """The highest fraction a bisection of ``sizes.calibration_steps`` can return."""
    low, high = CALIBRATION_RANGE
    return high - (high - low) / 2**sizes.calibration_steps - 1e-9


def _prep_meta(prep: Prepared, sizes: Sizes) -> dict[str, Any]:
    return {"trace": prep.trace, "fleet": prep.fleet, "requests": prep.requests,
            "refused": prep.refused, "calibration": prep.calibration,
            "calibration_capped": prep.calibration >= _cap(sizes),
            "wall_s": prep.wall_s}  # fmt: skip


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


# ---------------------------------------------------------------------------- summary


def by_cell(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, str, float], dict[str, dict]]:
    out: dict[tuple[str, str, float], dict[str, dict]] = {}
    for row in rows:
        out.setdefault((row["trace"], row["fleet"], row["load"]), {})[row["policy"]] = row
    return out


def _best(cell: dict[str, dict], key: str, *, low: bool = False) -> float:
    values = [cell[b][key] for b in BASELINES if cell.get(b, {}).get(key) is not None]
    if not values:
        return float("nan")
    return min(values) if low else max(values)


def _gap(cell: dict[str, dict], policy: str, key: str) -> float:
    mine = cell.get(policy, {}).get(key)
    return float("nan") if mine is None else mine - _best(cell, key)


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Flat numbers over the cells (module doc)."""
    cells = by_cell(rows)
    out: dict[str, Any] = {"cells": len(cells), "rows": len(rows)}
    for policy, tag in (("predictor", "predictor"), (PROFILED, "profiled")):
        for key, suffix in (("within_1s", "1s"), ("within_10s", "10s")):
            gaps = [_gap(c, policy, key) for c in cells.values()]
            out[f"cells_{tag}_ge_best_baseline_{suffix}"] = sum(g >= -1e-9 for g in gaps)
            worst = min(range(len(gaps)), key=lambda i: gaps[i], default=None)
            name = "worst_cell_gap" if tag == "predictor" else f"worst_cell_gap_{tag}"
            out[f"{name}_{suffix}"] = round(gaps[worst], 4) if worst is not None else None
            if tag == "predictor" and suffix == "1s" and worst is not None:
                out["worst_cell_1s"] = "/".join(f"{x:g}" if isinstance(x, float) else x
                                                for x in list(cells)[worst])  # fmt: skip
    out["cells_predictor_no_more_under"] = sum(
        all(c["predictor"][f"under_{b}s"] <= _best(c, f"under_{b}s", low=True) for b in UNDER)
        for c in cells.values() if "predictor" in c
    )  # fmt: skip
    for policy in ("predictor", PROFILED, *BASELINES):
        values = [c[policy]["within_1s"] for c in cells.values()
                  if c.get(policy, {}).get("within_1s") is not None]  # fmt: skip
        out[f"mean_within_1s_{policy}"] = round(sum(values) / len(values), 4) if values else None
    coverage = [c["predictor"]["p90_coverage"] for c in cells.values()
                if c.get("predictor", {}).get("p90_coverage") is not None]  # fmt: skip
    out["p90_coverage_min"] = round(min(coverage), 4) if coverage else None
    out["p90_coverage_max"] = round(max(coverage), 4) if coverage else None
    out["cells_p90_calibrated"] = sum(0.88 <= v <= 0.92 for v in coverage)
    first = {(r["trace"], r["fleet"]): r["refused"] for r in rows}
    out["refused_requests"] = sum(first.values())
    return out


# ---------------------------------------------------------------------------- table


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}"


def table(result: dict[str, Any]) -> str:
    """A markdown table: one line per cell, within 1 s / 10 s (%) of every policy, the
    gap to the best baseline (``**`` where the cold predictor loses), underpredictions at
    10 s (predictor / best baseline), samples and refused."""
    head = ["trace", "fleet", "load", "pred 1s", "prof 1s", "mooncake 1s", "linear 1s",
            "count 1s", "gap 1s", "pred 10s", "best base 10s", "under10 pred/base",
            "samples", "refused"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (trace, fleet, load), cell in by_cell(result["cells"]).items():
        pred = cell.get("predictor", {})
        gap1 = _gap(cell, "predictor", "within_1s")
        gap10 = _gap(cell, "predictor", "within_10s")
        mark1 = "**" if gap1 < -1e-9 else ""
        mark10 = "**" if gap10 < -1e-9 else ""
        under = f"{pred.get('under_10s', '—')}/{int(_best(cell, 'under_10s', low=True))}"
        line = [trace, fleet, f"{load:g}", f"{mark1}{_pct(pred.get('within_1s'))}{mark1}",
                _pct(cell.get(PROFILED, {}).get("within_1s"))]  # fmt: skip
        line += [_pct(cell.get(b, {}).get("within_1s")) for b in BASELINES]
        line += [f"{100 * gap1:+.1f}", f"{mark10}{_pct(pred.get('within_10s'))}{mark10}",
                 _pct(_best(cell, "within_10s")), under, str(pred.get("samples", "—")),
                 str(pred.get("refused", "—"))]  # fmt: skip
        lines.append("| " + " | ".join(line) + " |")
    s = result["summary"]
    lines.append("")
    lines.append(
        f"cells {s['cells']}: cold predictor ≥ best baseline within 1 s in "
        f"{s['cells_predictor_ge_best_baseline_1s']}, within 10 s in "
        f"{s['cells_predictor_ge_best_baseline_10s']}; worst 1 s gap {s['worst_cell_gap_1s']} "
        f"({s.get('worst_cell_1s', '—')}); wall {s['wall_s']} s, CPU {s['cpu_s']} s, "
        f"{s['jobs']} jobs, load average {s['load_average_1m']:.1f}"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- entry points


def run_matrix(quick: bool, *, jobs: int, seed: int = 0, limit: int | None = None,
               traces: Sequence[str] = TRACES, fleets: Sequence[str] | None = None,
               loads: Sequence[float] = LOADS, routing: str | None = None,
               max_tokens: str = "exact") -> dict[str, Any]:  # fmt: skip
    sizes = QUICK if quick else FULL
    fleets = fleets or (QUICK_FLEETS if quick else FLEETS)
    pairs = [(t, f) for f in fleets for t in traces]
    out = run_grid(pairs, loads, sizes, limit=limit or sizes.limit, seed=seed, jobs=jobs,
                   routing=routing, max_tokens=max_tokens)  # fmt: skip
    out["summary"]["mode"] = "matrix-quick" if quick else "matrix"
    return out


def run_single(trace: str, fleet: str, loads: Sequence[float], *, limit: int | None,
               seed: int, jobs: int, routing: str | None = None,
               max_tokens: str = "exact") -> dict[str, Any]:  # fmt: skip
    out = run_grid([(trace, fleet)], loads, SINGLE, limit=limit or SINGLE.limit, seed=seed,
                   jobs=jobs, routing=routing, max_tokens=max_tokens)  # fmt: skip
    out["summary"]["mode"] = "single"
    return out
