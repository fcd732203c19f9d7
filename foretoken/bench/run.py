"""`foretoken bench NAME`: run benchmarks, print their JSON, keep a copy under .run/bench/."""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# name -> module with ``run(quick: bool) -> dict``; `make bench` runs them all.
BENCHMARKS: dict[str, str] = {
    "index": "foretoken.bench.index_bench",
    "router": "foretoken.bench.router_bench",
    "lake": "foretoken.bench.lake_bench",
    "predict": "foretoken.bench.predict_bench",
    "route": "foretoken.bench.route_bench",
    "approx": "foretoken.bench.approx_bench",
    "real-engine": "foretoken.bench.real_engine_bench",
    "aiperf": "foretoken.bench.aiperf_bench",  # needs `make aiperf` (a venv of its own)
    "live-vs-replay": "foretoken.bench.live_vs_replay",
}
OUT_DIR = Path(".run/bench")


def run_one(name: str, quick: bool, **options: Any) -> dict[str, Any]:
    """``options``: a benchmark's own (e.g. ``replicas`` for ``route``)."""
    module = importlib.import_module(BENCHMARKS[name])
    fn: Callable[..., dict[str, Any]] = module.run
    started = time.time()
    result = fn(quick, **options)
    # ``summary`` also at the top: `--json | jq .summary.X` reads the same flat figures
    # as `--summary` does (it stays inside ``result`` too, where earlier reports had it).
    report = {"benchmark": name, "quick": quick, **options, "started_ts": started,
              "wall_s": round(time.time() - started, 3), "summary": result.get("summary"),
              "result": result}  # fmt: skip
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    suffix = "".join(f"-{k}{v}" for k, v in options.items())
    (OUT_DIR / f"{name}{suffix}.json").write_text(json.dumps(report, indent=2))
    return report


def run(names: list[str], quick: bool) -> list[dict[str, Any]]:
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise KeyError(f"unknown benchmark(s) {unknown}; known: {sorted(BENCHMARKS)}")
    return [run_one(n, quick) for n in names]
