"""TTFT prediction accuracy and routing quality on the Mooncake trace (PRODUCT.md §1, §4).

``python -m foretoken.bench.predict_bench [--quick] [--limit N]`` prints one JSON object (full mode:
the first ``FULL_REQUESTS`` requests of the trace; ``--limit 0``: all). Everything runs in
virtual time (:func:`foretoken.sim.replay.replay`) on the ``hetero`` fleet, at load factors 0.8,
1.0, 1.3 × the trace's :func:`~foretoken.sim.replay.capacity_speedup` ("estimate": an ideal router
reusing every prefix seen earlier, no decode or step overheads), and × a "calibrated"
capacity: the knee of least-outstanding-tokens (TTFT p95 = ``CALIBRATION_P95_S``), found by
bisection as a fraction of the no-reuse estimate (:func:`calibrate`).

**(a) Accuracy** (``accuracy``): per load, one replay where the live predictor
(:class:`~foretoken.sim.predictor_policy.PredictorPolicy`, cold start, learning online) routes
requests without bounds. In the same run, on the same admitted requests and the worker the
predictor chose, these also predict, from what a router knows then (the requests sent to
that worker without a first token yet: "ahead"; the cached tokens the index credited):

* ``mooncake``: ``P(N, K) = c0 + c1·(N−K) + c2·(N²−K²)`` per worker, fitted ONCE offline;
  TTFT = Σ P of the requests ahead + P of this one;
* ``linear_rate``: no N² term — TTFT = c0 + (uncached tokens ahead + own) / fitted rate;
* ``request_count``: TTFT = k·(requests ahead + 1), k fitted per worker;
* ``predictor_profiled``: a read replica of the live predictor whose fits start from the
  same offline samples; it follows the routing decisions through its ``grants`` path.

The offline fit is a separate *profiling replay*: cold prompts with the lengths of the
trace's last ``PROFILE_REQUESTS`` requests (unique content), round-robin, one every
``PROFILE_GAP_S``; least squares over each worker's requests that had it to themselves.
Grades over served requests: within 1 s / 10 s, |error| p50/p95/p99, bias; as requests
carry no bound here, the same-side-of-bound counts against B = 5, 10, 30 s:
underpredicted (predicted ≤ B < actual), would-have-been false alarm (predicted > B ≥
actual); cache disagreement, within 1 s split by agreement; how many requests were fully
cold and alone (``cold_sample_supply``) next to the samples the live fit took.

**(b) Routing quality** (``routing``): per load, one replay per policy (``predictor``,
``round-robin``, ``least-outstanding-tokens``, ``cache-aware``: longest prefix match with a
load-balance threshold, knowing nothing of queues, :mod:`foretoken.sim.cache_aware`) with
bounds from ``BOUND_MIX``: goodput (served within the bound; also per second of trace),
TTFT p50/p95/p99 of served requests and the engines' cache hit rate.
The predictor's run also gives §4 grades with real bounds (``bound_grades``):
underpredictions, and false alarms *estimated* from the explore admissions (their
within-bound fraction × rejections) and from actual-given-predicted on served requests.

Replays run in parallel processes (``--workers``); each records its wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from foretoken.bench.baselines import (
    MIN_PROMPT_TOKENS,
    SEED,
    BaselineFit,
    ShadowBaselines,
    _alone_and_ahead,
    _Served,
    profile_replay,
    warm_started_replica,
)
from foretoken.core.types import RequestId
from foretoken.settings import load_settings
from foretoken.sim.cache_aware import POLICY_NAME as CACHE_AWARE
from foretoken.sim.clients import BoundMix
from foretoken.sim.policy import (
    FleetLedger,
    make_policy,
)
from foretoken.sim.predictor_policy import PredictorPolicy
from foretoken.sim.replay import capacity_speedup, replay, summary
from foretoken.sim.spec import FleetSpec, load_fleet
from foretoken.sim.traces import TraceRequest, load_mooncake
from foretoken.wire.records import Graded

FLEET = "hetero"
LOADS = (0.8, 1.0, 1.3)
BOUNDS_S = (5.0, 10.0, 30.0)
BOUND_MIX = "5:0.3,10:0.3,30:0.4"
PROFILED_POLICY = "predictor-profiled"  # the predictor with fits started from the profile
POLICIES = ("predictor", PROFILED_POLICY, "round-robin", "least-outstanding-tokens", CACHE_AWARE)
BASELINES = ("mooncake", "linear_rate", "request_count")
PROFILED = "predictor_profiled"  # the live predictor's replica, fits warm-started
QUICK_REQUESTS = 250
# Full mode replays the trace's first FULL_REQUESTS requests (about 20 minutes of traffic):
# the whole trace (``--limit 0``) takes hours on a 2-CPU machine. Docs report which.
FULL_REQUESTS = 4000
PROFILE_REQUESTS = 480
QUICK_PROFILE_REQUESTS = 160
PROFILE_GAP_S = 2.0  # round-robin over 8 workers: one request per worker every 16 s
PROFILE_MAX_OUTPUT = 32
PROFILE_KEY_BASE = 1 << 50  # segment keys no trace request uses
WITHIN_S = (1.0, 10.0)
PERCENTILES = (50.0, 95.0, 99.0)
# Bins of predicted TTFT (s) for the conditional false-alarm estimate.
PREDICTED_BIN_EDGES_S = np.geomspace(0.05, 2000.0, 31)
CAPACITY_KINDS = ("estimate", "calibrated")
CALIBRATION_REQUESTS = 3000
CALIBRATION_RANGE = (0.2, 1.0)
CALIBRATION_P95_S = 10.0
MAX_PROCESSES = 4


# ---------------------------------------------------------------------------- grades


def _percentiles(values: np.ndarray, prefix: str) -> dict[str, float | None]:
    if not len(values):
        return {f"{prefix}_p{p:g}_s": None for p in PERCENTILES}
    qs = np.percentile(values, PERCENTILES)
    return {f"{prefix}_p{p:g}_s": round(float(q), 4) for p, q in zip(PERCENTILES, qs, strict=True)}


def _fraction(mask: np.ndarray) -> float | None:
    return round(float(mask.mean()), 4) if len(mask) else None


def error_grades(predicted: np.ndarray, actual: np.ndarray, disagree: np.ndarray) -> dict[str, Any]:
    """§4 grades of one predictor over served requests (``disagree``: 1, 0, or -1 unknown)."""
    error = predicted - actual
    size = np.abs(error)
    out: dict[str, Any] = {"served": len(actual)}
    for within in WITHIN_S:
        out[f"within_{within:g}s"] = _fraction(size <= within)
    out |= _percentiles(size, "abs_error")
    out["mean_error_s"] = round(float(error.mean()), 4) if len(error) else None
    out["within_1s_agreeing"] = _fraction(size[disagree == 0] <= 1.0)
    out["within_1s_disagreeing"] = _fraction(size[disagree == 1] <= 1.0)
    out["same_side_of_bound"] = {
        f"{bound:g}": {
            "actual_over_bound": int(np.sum(actual > bound)),
            "underpredicted": int(np.sum((predicted <= bound) & (actual > bound))),
            "would_be_false_alarm": int(np.sum((predicted > bound) & (actual <= bound))),
        }
        for bound in BOUNDS_S
    }
    return out


def accuracy(records: Sequence[Graded], shadow: ShadowBaselines, *,
             replica_routed: bool = False) -> dict[str, Any]:  # fmt: skip
    """The grades of every policy of a shadowed replay. ``replica_routed``: a baseline
    routed (its records carry no prediction), and the shadow's replica, the cold predictor,
    is graded as ``predictor`` (no p90 then)."""
    served = [
        r
        for r in records
        if r.status == "served" and r.actual_ttft_s is not None
        and (replica_routed or r.predicted_ttft_s is not None)
    ]  # fmt: skip
    actual = np.array([r.actual_ttft_s for r in served], dtype=float)
    flags = [r.cache_disagreement for r in served]
    disagree = np.array([-1 if f is None else int(f) for f in flags])
    known = disagree >= 0
    out: dict[str, Any] = {
        "requests": len(records),
        "rejected": sum(r.status == "rejected" for r in records),
        "cache_disagreement_rate": _fraction(disagree[known] == 1),
    }
    if not replica_routed:
        out["predicted_with_default_fit"] = _fraction(
            np.array([bool(r.fit_default) for r in served])
        )
        out["predictor"] = error_grades(
            np.array([r.predicted_ttft_s for r in served], dtype=float), actual, disagree
        )
        p90 = np.array([np.nan if r.predicted_ttft_p90_s is None else r.predicted_ttft_p90_s
                        for r in served], dtype=float)  # fmt: skip
        carried = ~np.isnan(p90)
        out["predictor"]["p90_coverage"] = _fraction(actual[carried] <= p90[carried])
        out["cold_sample_supply"] = cold_sample_supply(records)
    replica = "predictor" if replica_routed else PROFILED
    names = BASELINES + ((replica,) if shadow.replica is not None else ())
    table = np.array([shadow.predictions[r.request_id] for r in served],
                     dtype=float).reshape(-1, len(names))  # fmt: skip
    for index, name in enumerate(names):
        out[name] = error_grades(table[:, index], actual, disagree)
    return out


def cold_sample_supply(records: Sequence[Graded]) -> dict[str, int]:
    """Served requests (prompts of at least ``MIN_PROMPT_TOKENS``) with nothing cached
    (the engine says 0), alone (no other request on the worker, decoding or not, between
    their arrival and first token), and both: what a fit restricted to fully cold, fully
    alone samples could learn from (the live fit also takes reused prefixes and decoders)."""
    served = _Served.of(records)
    alone = np.zeros(len(served.ttft_s), dtype=bool)
    for worker in np.unique(served.worker):
        mine = served.worker == worker
        alone[mine] = _alone_and_ahead(
            served.arrival_s[mine], served.ttft_s[mine], served.e2e_s[mine]
        )[0]
    cold = (served.cached == 0) & (served.prompt >= MIN_PROMPT_TOKENS)
    return {
        "served": len(alone),
        "nothing_cached": int(cold.sum()),
        "alone": int(alone.sum()),
        "alone_and_nothing_cached": int((alone & cold).sum()),
    }


def _within_bound_given_predicted(served: Sequence[Graded], bound: float) -> np.ndarray:
    """Per bin of predicted TTFT, the fraction of served requests with actual ≤ bound
    (NaN for a bin without served requests)."""
    predicted = np.array([r.predicted_ttft_s or 0.0 for r in served])
    met = np.array([(r.actual_ttft_s or math.inf) <= bound for r in served])
    bins = np.digitize(predicted, PREDICTED_BIN_EDGES_S)
    return np.array(
        [
            met[bins == b].mean() if np.any(bins == b) else np.nan
            for b in range(len(PREDICTED_BIN_EDGES_S) + 1)
        ]
    )


def bound_grades(records: Sequence[Graded]) -> dict[str, Any]:
    """§4 grades with the requests' real bounds (the predictor's bounded run)."""
    served = [r for r in records if r.status == "served" and r.actual_ttft_s is not None]
    out: dict[str, Any] = {}
    for bound in BOUNDS_S:
        mine = [r for r in records if r.max_queue_wait_s == bound]
        done = [r for r in mine if r.status == "served" and r.actual_ttft_s is not None]
        rejected = [r for r in mine if r.status == "rejected"]
        explore = [r for r in done if r.explore]
        explore_met = sum((r.actual_ttft_s or math.inf) <= bound for r in explore)
        rate = _within_bound_given_predicted(served, bound)
        bins = np.digitize([r.predicted_ttft_s or 0.0 for r in rejected], PREDICTED_BIN_EDGES_S)
        estimates = rate[bins] if len(bins) else np.zeros(0)
        out[f"{bound:g}"] = {
            "requests": len(mine),
            "admitted": sum(r.admitted for r in mine),
            "served_within_bound": sum((r.actual_ttft_s or math.inf) <= bound for r in done),
            "underpredicted": sum(
                (r.predicted_ttft_s or 0.0) <= bound < (r.actual_ttft_s or 0.0) for r in done
            ),
            "rejected": len(rejected),
            "explore_admitted": len(explore),
            "explore_within_bound": int(explore_met),
            "false_alarms_est_explore": (
                round(len(rejected) * explore_met / len(explore), 1) if explore else None
            ),
            "false_alarms_est_conditional": round(float(np.nansum(estimates)), 1),
            "rejected_without_estimate": int(np.sum(np.isnan(estimates))),
        }
    return out


def routing_summary(records: Sequence[Graded], trace_span_s: float, speedup: float) -> dict:
    out = summary(records)
    out.pop("per_worker", None)
    out["goodput_per_s"] = round(out["goodput"] / (trace_span_s / speedup), 4)
    return out


# ---------------------------------------------------------------------------- jobs


@dataclass(frozen=True, slots=True)
class Job:
    policy: str  # a registered policy, or PROFILED_POLICY
    capacity: str  # "estimate" or "calibrated"
    load: float
    bounded: bool
    limit: int | None
    calibration: float  # the calibrated capacity as a fraction of the no-reuse one
    fits: dict[str, BaselineFit] = field(default_factory=dict)  # with fits: shadow baselines
    warm: bytes = b""  # the profile follower's fit snapshot (warm_started_replica)


def profile_trace(requests: int) -> list[TraceRequest]:
    """Cold prompts for the offline profile: the prompt lengths of the trace's last
    ``requests`` requests, each with unique content (nothing shared, nothing cached),
    outputs capped at ``PROFILE_MAX_OUTPUT``, one every ``PROFILE_GAP_S``."""
    tail = load_mooncake()[-requests:]
    return [
        TraceRequest(
            request_id=RequestId(f"profile-{i:05d}"),
            arrival_s=PROFILE_GAP_S * i,
            prompt_tokens=r.prompt_tokens,
            output_tokens=min(r.output_tokens, PROFILE_MAX_OUTPUT),
            segment_keys=(PROFILE_KEY_BASE + i,),
            segment_lengths=(r.prompt_tokens,),
        )
        for i, r in enumerate(tail)
    ]


def capacities(trace: Sequence[TraceRequest], fleet: FleetSpec, calibration: float) -> dict:
    return {
        "estimate": capacity_speedup(trace, fleet),
        "calibrated": calibration * capacity_speedup(trace, fleet, reuse_prefixes=False),
    }


def _policy(name: str, fleet: FleetSpec, warm: bytes) -> Any:
    if name == PROFILED_POLICY:
        return warm_started_replica(fleet, warm)
    if name == PredictorPolicy.name:
        # the processor's settings (TOML, environment): e.g. the index backend
        return PredictorPolicy.for_fleet(fleet, seed=SEED, settings=load_settings())
    return make_policy(name, FleetLedger.for_fleet(fleet), seed=SEED)


def run_job(job: Job) -> dict[str, Any]:
    fleet = load_fleet(FLEET)
    trace = load_mooncake(limit=job.limit)
    speedup = job.load * capacities(trace, fleet, job.calibration)[job.capacity]
    if job.bounded:
        trace = BoundMix.parse(BOUND_MIX).assign(trace, seed=SEED)
    policy = _policy(job.policy, fleet, job.warm)
    shadow = None
    if job.fits:
        replica = warm_started_replica(fleet, job.warm) if job.warm else None
        shadow = ShadowBaselines(policy, job.fits, replica)
    result = replay(trace, fleet, shadow or policy, speedup=speedup, progress=False)
    span_s = trace[-1].arrival_s - trace[0].arrival_s
    routing = routing_summary(result.records, span_s, speedup)
    if isinstance(policy, PredictorPolicy):
        routing["predictor_counters"] = asdict(policy.counters)
    out: dict[str, Any] = {"speedup": round(speedup, 4), "wall_s": round(result.wall_s, 1)}
    out |= {"virtual_s": round(result.virtual_s, 1), "routing": routing}
    if shadow is not None:
        out["accuracy"] = accuracy(result.records, shadow)
    if job.bounded and isinstance(policy, PredictorPolicy):
        out["bound_grades"] = bound_grades(result.records)
    return out


def profile(requests: int) -> dict[str, Any]:
    """The offline profile (module doc): a round-robin replay of cold prompts, one at a
    time per worker; the baselines' fits and the replica's starting samples."""
    fleet = load_fleet(FLEET)
    started = time.perf_counter()
    fitted = profile_replay(profile_trace(requests), fleet)
    fitted["wall_s"] = round(time.perf_counter() - started, 1)
    return fitted


def calibrate(requests: int, steps: int) -> dict[str, Any]:
    """The calibrated capacity: by bisection, the highest fraction of the no-reuse
    capacity at which least-outstanding-tokens keeps the TTFT p95 of the trace's first
    ``requests`` requests within ``CALIBRATION_P95_S`` (its knee)."""
    fleet, trace = load_fleet(FLEET), load_mooncake(limit=requests)
    base = capacity_speedup(trace, fleet, reuse_prefixes=False)
    low, high = CALIBRATION_RANGE
    probes = []
    for _ in range(steps):
        mid = (low + high) / 2
        policy = _policy("least-outstanding-tokens", fleet, b"")
        p95 = summary(replay(trace, fleet, policy, speedup=mid * base, progress=False).records)
        probes.append({"fraction": round(mid, 4), "ttft_p95_s": p95["ttft_p95_s"]})
        low, high = (mid, high) if p95["ttft_p95_s"] <= CALIBRATION_P95_S else (low, mid)
    return {"fraction_of_no_reuse": low, "requests": requests, "probes": probes}


def _jobs(limit: int | None, loads: Sequence[float], kinds: Sequence[str],
          calibration: float, profiled: dict[str, Any]) -> list[Job]:  # fmt: skip
    """The longest jobs (the predictor's) first, so the process pool packs well."""
    fits, warm = profiled["fits"], profiled["replica_fits"]
    grid = [(kind, load) for kind in kinds for load in loads]
    jobs = [Job(PredictorPolicy.name, k, x, False, limit, calibration, fits, warm) for k, x in grid]
    for name in POLICIES:
        jobs += [Job(name, k, x, True, limit, calibration, warm=warm) for k, x in grid]
    return jobs


def _arrange(jobs: Sequence[Job], results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Results keyed by capacity kind, then load: accuracy, routing per policy, timings."""
    out: dict[str, Any] = {}
    for job, r in zip(jobs, results, strict=True):
        slot = out.setdefault(job.capacity, {}).setdefault(
            f"{job.load:g}", {"speedup": r["speedup"], "routing": {}, "wall_s": {}}
        )
        key = job.policy if job.bounded else f"{job.policy} (no bounds)"
        slot["wall_s"][key] = r["wall_s"]
        if "accuracy" in r:
            slot["accuracy"] = r["accuracy"] | {"routing_without_bounds": r["routing"]}
        else:
            slot["routing"][job.policy] = r["routing"]
        if "bound_grades" in r:
            slot.setdefault("bound_grades", {})[job.policy] = r["bound_grades"]
    return out


def run(quick: bool, *, limit: int | None = None, workers: int | None = None,
        loads: Sequence[float] = LOADS, kinds: Sequence[str] | None = None) -> dict:  # fmt: skip
    """The whole benchmark (module doc) as one JSON-serializable dict: the first ``limit``
    requests (default ``FULL_REQUESTS``; 0 = all). Quick mode: ``QUICK_REQUESTS``
    requests, the estimated capacity only, a coarse calibration."""
    started = time.perf_counter()
    if limit is None:
        limit = QUICK_REQUESTS if quick else FULL_REQUESTS
    limit = limit or None  # 0: the whole trace
    kinds = kinds or (CAPACITY_KINDS[:1] if quick else CAPACITY_KINDS)
    fleet, trace = load_fleet(FLEET), load_mooncake(limit=limit)
    calibration = calibrate(min(len(trace), CALIBRATION_REQUESTS), 3 if quick else 6)
    profiled = profile(QUICK_PROFILE_REQUESTS if quick else PROFILE_REQUESTS)
    jobs = _jobs(limit, loads, kinds, calibration["fraction_of_no_reuse"], profiled)
    procs = workers or min(len(jobs), os.cpu_count() or 1, MAX_PROCESSES)
    with ProcessPoolExecutor(max_workers=procs) as pool:
        results = list(pool.map(run_job, jobs))
    caps = capacities(trace, fleet, calibration["fraction_of_no_reuse"])
    return {
        "mode": "quick" if quick else "full",
        "fleet": FLEET, "trace": "mooncake", "requests": len(trace), "bound_mix": BOUND_MIX,
        "capacity_speedup": {k: round(v, 4) for k, v in caps.items()},
        "calibration": calibration,
        "profile": {
            "requests": QUICK_PROFILE_REQUESTS if quick else PROFILE_REQUESTS,
            "gap_s": PROFILE_GAP_S, "served": profiled["profile_served"],
            "wall_s": profiled["wall_s"],
            "fits": {w: asdict(f) for w, f in profiled["fits"].items()},
        },
        "results": _arrange(jobs, results),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "processes": procs},
        "elapsed_s": round(time.perf_counter() - started, 1),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description="TTFT accuracy and routing (JSON on stdout).")
    parser.add_argument("--quick", action="store_true", help=f"first {QUICK_REQUESTS} requests")
    parser.add_argument("--limit", type=int, default=None, help="first N requests; 0 = all")
    parser.add_argument("--workers", type=int, default=None, help="parallel replay processes")
    parser.add_argument("--loads", default=",".join(f"{x:g}" for x in LOADS))
    parser.add_argument("--capacity", default=None, help="estimate and/or calibrated")
    args = parser.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    kinds = args.capacity.split(",") if args.capacity else None
    result = run(args.quick, limit=args.limit, workers=args.workers, loads=loads, kinds=kinds)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
