"""TTFT prediction accuracy and routing quality on the Mooncake trace (PRODUCT.md §1, §4).

``python -m bench.predict_bench [--quick]`` prints one JSON object. Everything runs in
virtual time (:func:`fleet.replay.replay`) on the ``hetero`` fleet, at load factors × the
trace's :func:`~fleet.replay.capacity_speedup` (0.8, 1.0, 1.3), plus the same factors × a
*calibrated* capacity (below).

**(a) Accuracy** (``accuracy``): one replay per load with the live predictor
(:class:`~fleet.predictor_policy.PredictorPolicy`) routing requests that carry no bound.
Three baselines predict, *in the same run*, the TTFT of every admitted request on the
worker the predictor chose (same routing, same requests, same engines), from what a router
knows at that moment: the requests it sent to that worker and has not seen a first token
for ("ahead"), and the cached tokens the predictor's index credited:

* ``mooncake``: Mooncake's estimate — a polynomial ``P(N, K) = c0 + c1·(N−K) + c2·(N²−K²)``
  per worker, fitted ONCE offline; TTFT = Σ P of the requests ahead + P of this one;
* ``linear_rate``: no N² term — TTFT = c0 + (uncached tokens ahead + own) / fitted rate;
* ``request_count``: TTFT = k·(requests ahead + 1), k fitted per worker.

Their offline fit is a separate *profiling replay*: the trace's last ``PROFILE_REQUESTS``
requests, round-robin, at ``PROFILE_LOAD`` × capacity, so most requests run alone; the
polynomial and the rate are least-squares fits over each worker's requests that had the
worker to themselves (nothing else ran between their arrival and first token), ``k`` over
all of the worker's requests. Grades (PRODUCT.md §4) over served requests: within 1 s /
10 s, |error| p50/p95/p99, bias, and — requests carry no bound in this run — the
same-side-of-bound counts against hypothetical bounds B = 5, 10, 30 s: underpredicted
(predicted ≤ B < actual) and would-have-been false alarm (predicted > B ≥ actual); the
cache-disagreement rate, within 1 s split by agreement.

**(b) Routing quality** (``routing``): per load, one replay per policy (``predictor``,
``round-robin``, ``least-outstanding-tokens``) with bounds from ``BOUND_MIX``: goodput
(served within the bound), goodput per second of trace, TTFT p50/p95/p99 of served
requests. The predictor's run also gives the §4 grades with real bounds
(``bound_grades``): underpredictions, and false alarms *estimated* two ways — from the
explore admissions (would-be rejections admitted anyway: their within-bound fraction ×
rejections) and from the distribution of actual TTFT given the predicted one on served
requests (binned).

**Calibrated capacity.** ``capacity_speedup`` assumes an ideal router (every prefix seen
earlier in the trace is reused, 37% of prompt tokens) and leaves decode and step
overheads out. The calibrated capacity drops the reuse (``reuse_prefixes=False``): the
capacity when nothing is reused, closer to what a router that spreads load achieves.

Replays run in parallel worker processes (``--workers``); each result records its wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from fleet.policy import Decision, FleetLedger, FleetView, RouteRequest, RoutingPolicy, make_policy
from fleet.predictor_policy import PredictorPolicy
from fleet.replay import EPOCH_BASE_TS, capacity_speedup, replay, summary
from fleet.spec import FleetSpec, load_fleet
from fleet.traces import BoundMix, TraceRequest, load_mooncake
from foretoken.ids import RequestId, WorkerId
from streams.records import Graded, KvEvent

FLEET = "hetero"
LOADS = (0.8, 1.0, 1.3)
BOUNDS_S = (5.0, 10.0, 30.0)
BOUND_MIX = "5:0.3,10:0.3,30:0.4"
POLICIES = ("predictor", "round-robin", "least-outstanding-tokens")
BASELINES = ("mooncake", "linear_rate", "request_count")
QUICK_REQUESTS = 300
PROFILE_REQUESTS = 480
QUICK_PROFILE_REQUESTS = 160
PROFILE_LOAD = 0.05
MIN_PROMPT_TOKENS = 128  # as the live fit: below this fixed latency dominates
MIN_WORKER_SAMPLES = 4  # fewer alone requests on a worker: its baselines use the pooled fit
WITHIN_S = (1.0, 10.0)
PERCENTILES = (50.0, 95.0, 99.0)
# Bins of predicted TTFT (s) for the conditional false-alarm estimate.
PREDICTED_BIN_EDGES_S = np.geomspace(0.05, 2000.0, 31)
CAPACITY_KINDS = ("estimate", "calibrated")
SEED = 0


# ---------------------------------------------------------------------------- baselines


@dataclass(frozen=True, slots=True)
class BaselineFit:
    """One worker's offline baseline parameters (seconds, tokens)."""

    poly: tuple[float, float, float]  # P(N, K) = c0 + c1·(N−K) + c2·(N²−K²)
    linear: tuple[float, float]  # c0, seconds per uncached token (1 / rate)
    per_request_s: float  # k
    alone_samples: int
    pooled: bool = False

    def prefill_s(self, n: int, k: int) -> float:
        c0, c1, c2 = self.poly
        return max(c0 + c1 * (n - k) + c2 * (n * n - k * k), 0.0)


def _lstsq(columns: Sequence[np.ndarray], y: np.ndarray) -> tuple[float, ...]:
    """Least squares with columns scaled to max 1 (N² spans ten decades)."""
    scale = np.array([max(float(np.max(np.abs(c))), 1e-30) for c in columns])
    matrix = np.stack([c / s for c, s in zip(columns, scale, strict=True)], axis=1)
    theta, *_ = np.linalg.lstsq(matrix, y, rcond=None)
    return tuple(float(t) for t in theta / scale)


@dataclass(frozen=True, slots=True)
class _Served:
    """The served requests of a replay as columns (arrival in virtual seconds)."""

    worker: np.ndarray
    arrival_s: np.ndarray
    ttft_s: np.ndarray
    e2e_s: np.ndarray
    prompt: np.ndarray
    cached: np.ndarray

    @classmethod
    def of(cls, records: Iterable[Graded]) -> _Served:
        rows = [r for r in records if r.status == "served" and r.actual_ttft_s is not None]
        return cls(
            np.array([r.worker_id for r in rows]),
            np.array([r.ts - EPOCH_BASE_TS for r in rows]),
            np.array([r.actual_ttft_s for r in rows], dtype=float),
            np.array([r.e2e_s or 0.0 for r in rows]),
            np.array([r.prompt_tokens for r in rows], dtype=float),
            np.array([r.engine_cached_tokens or 0 for r in rows], dtype=float),
        )


def _alone_and_ahead(arrival: np.ndarray, ttft: np.ndarray, e2e: np.ndarray) -> tuple[Any, Any]:
    """Per request of one worker: whether nothing else ran there between its arrival and
    its first token, and how many requests sent before it still awaited a first token."""
    start, first = arrival[:, None], (arrival + ttft)[:, None]
    others = ~np.eye(len(arrival), dtype=bool)
    overlap = (arrival[None, :] < first) & ((arrival + e2e)[None, :] > start) & others
    ahead = (arrival[None, :] < start) & ((arrival + ttft)[None, :] > start) & others
    return ~overlap.any(axis=1), ahead.sum(axis=1)


def fit_baselines(records: Sequence[Graded], workers: Sequence[WorkerId]) -> dict[str, Any]:
    """Per worker :class:`BaselineFit` from a profiling replay's records."""
    served = _Served.of(records)
    per_worker: dict[str, tuple[np.ndarray, ...]] = {}
    pooled: list[tuple[np.ndarray, ...]] = []
    for worker in workers:
        mine = served.worker == worker
        alone, ahead = _alone_and_ahead(
            served.arrival_s[mine], served.ttft_s[mine], served.e2e_s[mine]
        )
        use = alone & (served.prompt[mine] >= MIN_PROMPT_TOKENS)
        cols = (
            served.prompt[mine][use],
            served.cached[mine][use],
            served.ttft_s[mine][use],
            served.ttft_s[mine],
            ahead + 1.0,
        )
        per_worker[worker] = cols
        pooled.append(cols)
    everyone = tuple(np.concatenate([c[i] for c in pooled]) for i in range(5))
    fits = {w: _fit_one(cols, everyone) for w, cols in per_worker.items()}
    return {"fits": fits, "profile_served": len(served.ttft_s)}


def _fit_one(cols: tuple[np.ndarray, ...], everyone: tuple[np.ndarray, ...]) -> BaselineFit:
    n, k, y, all_y, load = cols
    pooled = len(y) < MIN_WORKER_SAMPLES
    if pooled:
        n, k, y = everyone[0], everyone[1], everyone[2]
    u, v = n - k, n * n - k * k
    ones = np.ones_like(u)
    poly = _lstsq((ones, u, v), y)
    linear = _lstsq((ones, u), y)
    per_request = float(np.dot(all_y, load) / np.dot(load, load)) if len(load) else 0.0
    return BaselineFit(
        (poly[0], poly[1], poly[2]), (linear[0], linear[1]), per_request, len(cols[2]), pooled
    )


@dataclass(slots=True)
class _Ahead:
    prefill_s: float
    uncached: int


class ShadowBaselines:
    """Routes with ``inner``; at each admission the baselines predict the request's TTFT on
    the chosen worker from the requests sent there without a first token yet."""

    def __init__(self, inner: RoutingPolicy, fits: dict[str, BaselineFit]) -> None:
        self.inner, self.fits = inner, fits
        self.name = inner.name
        self.kv_events = inner.kv_events
        self.awaiting: dict[WorkerId, dict[RequestId, _Ahead]] = {}
        self.predictions: dict[RequestId, tuple[float, float, float]] = {}

    def decide(self, request: RouteRequest, fleet: FleetView) -> Decision:
        decision = self.inner.decide(request, fleet)
        worker = decision.worker_id
        if worker is None:
            return decision
        n = request.prompt_tokens
        k = min(decision.cached_tokens or 0, max(n - 1, 0))
        fit = self.fits[worker]
        ahead = self.awaiting.setdefault(worker, {})
        own = _Ahead(fit.prefill_s(n, k), n - k)
        queued_s = sum(a.prefill_s for a in ahead.values())
        queued_tokens = sum(a.uncached for a in ahead.values())
        c0, per_token = fit.linear
        self.predictions[request.request_id] = (
            queued_s + own.prefill_s,
            max(c0 + per_token * (queued_tokens + own.uncached), 0.0),
            fit.per_request_s * (len(ahead) + 1),
        )
        ahead[request.request_id] = own
        return decision

    def _done(self, request_id: RequestId, worker_id: WorkerId) -> None:
        self.awaiting.get(worker_id, {}).pop(request_id, None)

    def on_kv_events(self, worker_id: WorkerId, events: Sequence[KvEvent], t_s: float) -> None:
        self.inner.on_kv_events(worker_id, events, t_s)

    def on_first_token(
        self,
        request_id: RequestId,
        worker_id: WorkerId,
        ttft_s: float,
        engine_cached_tokens: int | None,
        t_s: float,
    ) -> None:
        self._done(request_id, worker_id)
        self.inner.on_first_token(request_id, worker_id, ttft_s, engine_cached_tokens, t_s)

    def on_finished(
        self,
        request_id: RequestId,
        worker_id: WorkerId,
        output_tokens: int,
        e2e_s: float,
        t_s: float,
        error: str | None = None,
    ) -> None:
        self._done(request_id, worker_id)
        self.inner.on_finished(request_id, worker_id, output_tokens, e2e_s, t_s, error)


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


def accuracy(records: Sequence[Graded], shadow: ShadowBaselines) -> dict[str, Any]:
    served = [
        r
        for r in records
        if r.status == "served" and r.actual_ttft_s is not None and r.predicted_ttft_s is not None
    ]
    actual = np.array([r.actual_ttft_s for r in served], dtype=float)
    flags = [r.cache_disagreement for r in served]
    disagree = np.array([-1 if f is None else int(f) for f in flags])
    known = disagree >= 0
    out: dict[str, Any] = {
        "requests": len(records),
        "rejected": sum(r.status == "rejected" for r in records),
        "cache_disagreement_rate": _fraction(disagree[known] == 1),
        "predicted_with_default_fit": _fraction(np.array([bool(r.fit_default) for r in served])),
        "predictor": error_grades(
            np.array([r.predicted_ttft_s for r in served], dtype=float), actual, disagree
        ),
    }
    out["cold_sample_supply"] = cold_sample_supply(records)
    table = np.array([shadow.predictions[r.request_id] for r in served]).reshape(-1, 3)
    for index, name in enumerate(BASELINES):
        out[name] = error_grades(table[:, index], actual, disagree)
    return out


def cold_sample_supply(records: Sequence[Graded]) -> dict[str, int]:
    """How many served requests could be cold prefill samples: nothing cached (engine
    says 0), alone on their worker until their first token, both (what the live fit
    accepts, prompts of at least ``MIN_PROMPT_TOKENS``)."""
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
    policy: str
    capacity: str  # "estimate" or "calibrated"
    load: float
    bounded: bool
    limit: int | None
    fits: dict[str, BaselineFit] = field(default_factory=dict)  # with fits: shadow baselines


def _trace(limit: int | None, tail: bool = False) -> list[TraceRequest]:
    if not tail:
        return load_mooncake(limit=limit)
    everything = load_mooncake()
    return everything[-limit:] if limit else everything


def capacities(trace: Sequence[TraceRequest], fleet: FleetSpec) -> dict[str, float]:
    return {
        "estimate": capacity_speedup(trace, fleet),
        "calibrated": capacity_speedup(trace, fleet, reuse_prefixes=False),
    }


def _policy(name: str, fleet: FleetSpec) -> RoutingPolicy:
    if name == PredictorPolicy.name:
        return PredictorPolicy.for_fleet(fleet, seed=SEED)
    return make_policy(name, FleetLedger.for_fleet(fleet), seed=SEED)


def run_job(job: Job) -> dict[str, Any]:
    fleet = load_fleet(FLEET)
    trace = _trace(job.limit)
    speedup = job.load * capacities(trace, fleet)[job.capacity]
    if job.bounded:
        trace = BoundMix.parse(BOUND_MIX).assign(trace, seed=SEED)
    policy: RoutingPolicy = _policy(job.policy, fleet)
    shadow = ShadowBaselines(policy, job.fits) if job.fits else None
    result = replay(trace, fleet, shadow or policy, speedup=speedup, progress=False)
    span_s = trace[-1].arrival_s - trace[0].arrival_s
    out: dict[str, Any] = {
        "policy": job.policy,
        "capacity": job.capacity,
        "load": job.load,
        "bounded": job.bounded,
        "speedup": round(speedup, 4),
        "wall_s": round(result.wall_s, 1),
        "virtual_s": round(result.virtual_s, 1),
        "routing": routing_summary(result.records, span_s, speedup),
    }
    if isinstance(policy, PredictorPolicy):
        out["predictor_counters"] = asdict(policy.counters)
    if shadow is not None:
        out["accuracy"] = accuracy(result.records, shadow)
    if job.bounded and job.policy == PredictorPolicy.name:
        out["bound_grades"] = bound_grades(result.records)
    return out


def profile(requests: int) -> dict[str, Any]:
    """The baselines' offline fit: a round-robin replay of the trace's last requests at a
    load where most run alone (module doc)."""
    fleet = load_fleet(FLEET)
    trace = _trace(requests, tail=True)
    speedup = PROFILE_LOAD * capacity_speedup(trace, fleet)
    started = time.perf_counter()
    result = replay(trace, fleet, _policy("round-robin", fleet), speedup=speedup, progress=False)
    fitted = fit_baselines(result.records, [spec.id for spec in fleet.engines])
    fitted["wall_s"] = round(time.perf_counter() - started, 1)
    fitted["speedup"] = round(speedup, 4)
    return fitted


def _jobs(
    limit: int | None,
    loads: Sequence[float],
    capacity_kinds: Sequence[str],
    fits: dict[str, BaselineFit],
) -> list[Job]:
    jobs = []
    for capacity in capacity_kinds:
        for load in loads:
            jobs.append(Job(PredictorPolicy.name, capacity, load, False, limit, fits))
            jobs += [Job(name, capacity, load, True, limit) for name in POLICIES]
    return jobs


def _arrange(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Results keyed by capacity kind, then load: accuracy and routing per policy."""
    out: dict[str, Any] = {}
    for r in results:
        slot = out.setdefault(r["capacity"], {}).setdefault(
            f"{r['load']:g}", {"speedup": r["speedup"], "routing": {}, "timings_s": {}}
        )
        key = f"{r['policy']}{'' if r['bounded'] else ' (no bounds)'}"
        slot["timings_s"][key] = r["wall_s"]
        if "accuracy" in r:
            slot["accuracy"] = r["accuracy"] | {"routing_unbounded": r["routing"]}
            slot["accuracy"]["predictor_counters"] = r.get("predictor_counters")
        else:
            slot["routing"][r["policy"]] = r["routing"]
        if "bound_grades" in r:
            slot["bound_grades"] = r["bound_grades"]
            slot["routing"][r["policy"]]["predictor_counters"] = r.get("predictor_counters")
    return out


def run(
    quick: bool,
    *,
    limit: int | None = None,
    workers: int | None = None,
    loads: Sequence[float] = LOADS,
    capacity_kinds: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The whole benchmark (module doc) as one JSON-serializable dict. Quick mode: the
    first ``QUICK_REQUESTS`` requests and the estimated capacity only."""
    started = time.perf_counter()
    if limit is None and quick:
        limit = QUICK_REQUESTS
    if capacity_kinds is None:
        capacity_kinds = CAPACITY_KINDS[:1] if quick else CAPACITY_KINDS
    fleet = load_fleet(FLEET)
    trace = _trace(limit)
    profiled = profile(QUICK_PROFILE_REQUESTS if quick else PROFILE_REQUESTS)
    fits: dict[str, BaselineFit] = profiled["fits"]
    jobs = _jobs(limit, loads, capacity_kinds, fits)
    procs = workers or min(len(jobs), os.cpu_count() or 1, 4)
    with ProcessPoolExecutor(max_workers=procs) as pool:
        results = list(pool.map(run_job, jobs))
    return {
        "mode": "quick" if quick else "full",
        "fleet": FLEET,
        "trace": "mooncake",
        "requests": len(trace),
        "bound_mix": BOUND_MIX,
        "capacity_speedup": {k: round(v, 4) for k, v in capacities(trace, fleet).items()},
        "profile": {
            "requests": QUICK_PROFILE_REQUESTS if quick else PROFILE_REQUESTS,
            "load": PROFILE_LOAD,
            "speedup": profiled["speedup"],
            "served": profiled["profile_served"],
            "wall_s": profiled["wall_s"],
            "fits": {w: asdict(f) for w, f in fits.items()},
        },
        "results": _arrange(results),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "processes": procs,
        },
        "elapsed_s": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="TTFT accuracy and routing (JSON on stdout).")
    parser.add_argument("--quick", action="store_true", help=f"first {QUICK_REQUESTS} requests")
    parser.add_argument("--limit", type=int, default=None, help="first N requests of the trace")
    parser.add_argument("--workers", type=int, default=None, help="parallel replay processes")
    parser.add_argument("--loads", default=",".join(f"{x:g}" for x in LOADS))
    parser.add_argument(
        "--capacity", default=None, help="capacity kinds, comma-separated: estimate, calibrated"
    )
    args = parser.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    kinds = [k.strip() for k in args.capacity.split(",")] if args.capacity else None
    result = run(
        args.quick, limit=args.limit, workers=args.workers, loads=loads, capacity_kinds=kinds
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
