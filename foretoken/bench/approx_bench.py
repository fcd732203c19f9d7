"""What the approximate cache mode costs in accuracy (issue 9): the live predictor on engines
that publish KV events and report cached tokens (``predictor``) against the same predictor
on engines that say nothing (``predictor-approx``: credit from routed prompts only, aged by
TTL and capacity; unknown reuse; cold samples only from never-seen prefixes on idle
workers), in the same process, on the same trace and fleet, in virtual time.

``python -m foretoken.bench.approx_bench [--quick] [--limit N]`` prints one JSON object. The fleet
is
``hetero``, the trace Mooncake's first ``FULL_REQUESTS`` (``QUICK_REQUESTS``) requests at
the trace's pace, no bounds. Per policy: within 1 s / 10 s of served requests with a
prediction, |error| p50/p95/p99, the cache disagreement (credited vs what the simulated
engine actually reused — the approximate policy never sees the latter, the replay's records
do), credited against reused tokens, the prefill samples the fits took, and wall time.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from foretoken.sim.predictor_policy import ApproxPredictorPolicy, PredictorPolicy
from foretoken.sim.replay import replay
from foretoken.sim.spec import load_fleet
from foretoken.sim.traces import load_mooncake
from foretoken.wire.records import Graded

FLEET = "hetero"
FULL_REQUESTS = 1500
QUICK_REQUESTS = 300


def grades(records: tuple[Graded, ...]) -> dict[str, Any]:
    served = [r for r in records if r.status == "served"]
    errors = np.array([r.error_s for r in served if r.error_s is not None], dtype=float)
    abs_err = np.abs(errors)
    known = [r for r in served if r.cache_disagreement is not None]
    agreeing = [r for r in known if not r.cache_disagreement and r.error_s is not None]
    disagreeing = [r for r in known if r.cache_disagreement and r.error_s is not None]

    def within_1s(rows: list[Graded]) -> float | None:
        return sum(abs(r.error_s or 0.0) <= 1.0 for r in rows) / len(rows) if rows else None

    p50, p95, p99 = (np.percentile(abs_err, [50, 95, 99]).tolist() if errors.size
                     else (None, None, None))  # fmt: skip
    return {
        "requests": len(records),
        "served": len(served),
        "predicted": int(errors.size),
        "within_1s": float(np.mean(abs_err <= 1.0)) if errors.size else None,
        "within_10s": float(np.mean(abs_err <= 10.0)) if errors.size else None,
        "abs_error_p50_s": p50,
        "abs_error_p95_s": p95,
        "abs_error_p99_s": p99,
        "cache_disagreement": sum(bool(r.cache_disagreement) for r in known) / len(known)
        if known else None,
        "within_1s_agreeing": within_1s(agreeing),
        "within_1s_disagreeing": within_1s(disagreeing),
        "credited_tokens": sum(r.credited_cached_tokens for r in served),
        "engine_reused_tokens": sum(r.engine_cached_tokens or 0 for r in served),
        "prompt_tokens": sum(r.prompt_tokens for r in served),
    }  # fmt: skip


def run(quick: bool, limit: int | None = None) -> dict[str, Any]:
    n = limit or (QUICK_REQUESTS if quick else FULL_REQUESTS)
    fleet, trace = load_fleet(FLEET), load_mooncake(limit=n)
    out: dict[str, Any] = {"fleet": FLEET, "trace": "mooncake", "requests": n, "policies": {}}
    for cls in (PredictorPolicy, ApproxPredictorPolicy):
        policy = cls.for_fleet(fleet, seed=0)
        started = time.perf_counter()
        result = replay(trace, fleet, policy, progress=False)
        row = grades(result.records)
        row["cold_samples"] = policy.counters.cold_samples
        row["wall_s"] = round(time.perf_counter() - started, 2)
        row["virtual_s"] = round(result.virtual_s, 1)
        out["policies"][policy.name] = row
    exact, approx = out["policies"]["predictor"], out["policies"]["predictor-approx"]
    if exact["within_1s"] and approx["within_1s"] is not None:
        out["within_1s_ratio_approx_vs_events"] = round(approx["within_1s"] / exact["within_1s"], 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    print(json.dumps(run(args.quick, args.limit), indent=2))


if __name__ == "__main__":
    main()
