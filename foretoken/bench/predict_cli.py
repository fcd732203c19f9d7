"""`foretoken bench predict` with options: the accuracy matrix, one trace × fleet, or the
error decomposition; a table on stdout, the JSON to ``--json`` (and .run/bench/)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from foretoken.bench.accuracy_matrix import TRACES, run_matrix, run_single, table
from foretoken.sim.clients import MaxTokensModel

OUT = Path(".run/bench")


def _write(result: dict[str, Any], json_path: str | None, stem: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=1, default=float)
    (OUT / f"{stem}.json").write_text(text)
    if json_path:
        Path(json_path).write_text(text)


def predict_command(*, quick: bool, trace: str | None, fleet: str | None, loads: str,
                    load: float | None, limit: int | None, seed: int, matrix: bool, jobs: int,
                    explain: bool, json_path: str | None,
                    routing: str | None = None, max_tokens: str = "exact") -> None:  # fmt: skip
    try:
        levels = [load] if load is not None else [float(x) for x in loads.split(",") if x]
    except ValueError as exc:
        raise ValueError(f"--loads {loads!r}: comma-separated numbers, e.g. 0.8,1.0,1.3") from exc
    if not levels or not all(math.isfinite(x) and x > 0 for x in levels):
        raise ValueError(f"--loads / --load must be positive numbers, got {levels}")
    max_tokens = MaxTokensModel.parse(max_tokens).label
    if routing is not None:
        import foretoken.sim.cache_aware  # noqa: F401  (registers cache-aware)
        from foretoken.sim.policy import policy_names

        if routing not in policy_names() or routing.startswith("predictor"):
            known = ", ".join(n for n in policy_names() if not n.startswith("predictor"))
            raise ValueError(f"--routing {routing!r}: give a baseline routing policy ({known})")
    if explain:
        from foretoken.bench.explain import explain_command, explain_table

        result = explain_command(trace or "poisson-long", fleet or "hetero", levels,
                                 limit=limit, seed=seed, jobs=jobs,
                                 max_tokens=max_tokens)  # fmt: skip
        _write(result, json_path, "predict-explain")
        print(explain_table(result))
        return
    if matrix:
        # e.g. the held-out grading: --matrix --quick --fleet random-4,random-5,random-8 --seed 1
        traces = tuple(t for t in (trace or "").split(",") if t) or TRACES
        fleets = tuple(f for f in (fleet or "").split(",") if f) or None
        result = run_matrix(quick, jobs=jobs, seed=seed, limit=limit, loads=levels,
                            routing=routing, traces=traces, fleets=fleets,
                            max_tokens=max_tokens)  # fmt: skip
        _write(result, json_path, "predict-matrix-quick" if quick else "predict-matrix")
    else:
        if not (trace and fleet):
            raise ValueError("give --trace and --fleet (or --matrix)")
        result = run_single(trace, fleet, levels, limit=limit, seed=seed, jobs=jobs,
                            routing=routing, max_tokens=max_tokens)  # fmt: skip
        _write(result, json_path, "predict-cells")
    print(table(result))
