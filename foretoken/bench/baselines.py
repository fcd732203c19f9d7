"""The baselines the predictor is measured against, in the same run: the Mooncake-style
polynomial per worker (fitted once offline, queue = the queued requests' prefill times),
linear rate and request count; and the predictor with fits warm-started from the same
offline profile."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from foretoken.core.types import RequestId, WorkerId, WorkerProfile
from foretoken.settings import load_settings
from foretoken.sim.policy import (
    Arrival,
    Decision,
    FinishedSeen,
    FirstTokenSeen,
    FleetLedger,
    FleetView,
    RoutingPolicy,
    make_policy,
)
from foretoken.sim.predictor_policy import PredictorPolicy
from foretoken.sim.replay import EPOCH_BASE_TS, replay
from foretoken.sim.spec import FleetSpec
from foretoken.sim.traces import TraceRequest
from foretoken.wire.records import Graded, KvEvent

MIN_PROMPT_TOKENS = 128  # as the live fit: below this fixed latency dominates
MIN_WORKER_SAMPLES = 4  # fewer alone requests on a worker: its baselines use the pooled fit
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
    """Least squares with columns scaled to max 1 (N² spans ten decades); zeros without a
    sample (a trace too short for a worker, or for the fleet, to have one)."""
    if not len(y):
        return tuple(0.0 for _ in columns)
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


def profile_replay(requests: Sequence[TraceRequest], fleet: FleetSpec) -> dict[str, Any]:
    """The offline profile: ``requests`` replayed round-robin; the baselines' fits from its
    records and, in ``replica_fits``, the fit snapshot of a predictor that followed it
    (:func:`warm_started_replica`)."""
    inner = make_policy("round-robin", FleetLedger.for_fleet(fleet), seed=SEED)
    follower = learning_replica(fleet)
    result = replay(requests, fleet, ShadowBaselines(inner, None, follower), progress=False)
    fitted = fit_baselines(result.records, [spec.id for spec in fleet.engines])
    fitted["replica_fits"] = follower.service.fits.snapshot()
    return fitted


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


def learning_replica(fleet: FleetSpec) -> PredictorPolicy:
    """A predictor that does not route: it learns from a replay it follows
    (:class:`ShadowBaselines` with no baseline fits), as a read replica would."""
    return PredictorPolicy.for_fleet(fleet, seed=SEED, settings=load_settings())


def warm_started_replica(fleet: FleetSpec, fits: bytes | None) -> PredictorPolicy:
    """A read replica of the predictor whose fits start from ``fits`` — the snapshot of a
    replica that followed the offline profile's replay and learned from it through its own
    pipeline (cold samples less their steps' overheads once a step cost is learned, decode
    steps, partial prefills) — then keep learning online. Fed the profile's raw TTFTs
    instead, its curve took each chunk's step overhead into ``a`` (28 against a true
    18 µs/token on 1,024-token chunks) and the queue walk added the overheads again."""
    replica = learning_replica(fleet)
    if fits:
        replica.service.fits.restore(fits)
    return replica


class ShadowBaselines:
    """Routes with ``inner``; at each admission the baselines predict the request's TTFT on
    the chosen worker from the requests sent there without a first token yet. With a
    ``replica`` (a :class:`PredictorPolicy` that does not route), it predicts for the same
    worker, then follows the decision through its ``grants`` path, as a read replica.
    Without ``fits`` no baseline predicts: the replica only follows (and learns)."""

    def __init__(self, inner: RoutingPolicy, fits: dict[str, BaselineFit] | None,
                 replica: PredictorPolicy | None = None) -> None:  # fmt: skip
        self.inner, self.fits, self.replica = inner, fits, replica
        self.name = inner.name
        # the replica keeps its own cache index: it needs the KV events whatever the inner
        # policy needs (a cache-aware baseline reads the fleet's caches and asks for none)
        details = [inner.kv_events] + ([replica.kv_events] if replica is not None else [])
        self.kv_events = min(details, key=("full", "hashes", "off").index)
        self.awaiting: dict[WorkerId, dict[RequestId, _Ahead]] = {}
        self.predictions: dict[RequestId, tuple[float, ...]] = {}

    def decide(self, request: Arrival, fleet: FleetView) -> Decision:
        decision = self.inner.decide(request, fleet)
        worker = decision.worker_id
        if worker is None:
            return decision
        if self.fits is None:
            if self.replica is not None:
                self.replica.on_grant(decision.grant(request, request.arrival_s), request.arrival_s)
            return decision
        n = request.prompt_tokens
        k = min(decision.cached_tokens or 0, max(n - 1, 0))
        fit = self.fits[worker]
        ahead = self.awaiting.setdefault(worker, {})
        own = _Ahead(fit.prefill_s(n, k), n - k)
        queued_s = sum(a.prefill_s for a in ahead.values())
        queued_tokens = sum(a.uncached for a in ahead.values())
        c0, per_token = fit.linear
        predicted: tuple[float, ...] = (
            queued_s + own.prefill_s,
            max(c0 + per_token * (queued_tokens + own.uncached), 0.0),
            fit.per_request_s * (len(ahead) + 1),
        )
        ahead[request.request_id] = own
        if self.replica is not None:
            mine = self.replica.predict_on(request, worker)
            predicted += (math.nan if mine is None else mine.predicted_ttft_s,)
            self.replica.on_grant(decision.grant(request, request.arrival_s), request.arrival_s)
        self.predictions[request.request_id] = predicted
        return decision

    def register(self, profile: WorkerProfile) -> None:
        """A re-registration (a schedule's version change): to every predictor it wraps."""
        for policy in self._others():
            register = getattr(policy, "register", None)
            if register is not None:
                register(profile)

    def _done(self, request_id: RequestId, worker_id: WorkerId) -> None:
        self.awaiting.get(worker_id, {}).pop(request_id, None)

    def _others(self) -> list[RoutingPolicy]:
        return [self.inner] if self.replica is None else [self.inner, self.replica]

    def on_kv_events(self, worker_id: WorkerId, events: Sequence[KvEvent], t_s: float) -> None:
        for policy in self._others():
            policy.on_kv_events(worker_id, events, t_s)

    def on_first_token(self, seen: FirstTokenSeen) -> None:
        self._done(seen.request_id, seen.worker_id)
        for policy in self._others():
            policy.on_first_token(seen)

    def on_finished(self, seen: FinishedSeen) -> None:
        self._done(seen.request_id, seen.worker_id)
        for policy in self._others():
            policy.on_finished(seen)
