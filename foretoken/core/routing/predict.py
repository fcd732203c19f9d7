"""Predictions: for every worker that could serve a request, TTFT = queue wait + own
prefill (PRODUCT.md §1), from the cache index (what is cached where), the worker's fits (how
fast it prefills) and its queue model (what is ahead, walked through the engine's step
scheduler with the settings the worker reported)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from foretoken.core.cost.registry import FitRegistry
from foretoken.core.index.protocol import Index
from foretoken.core.index.state import CacheHit
from foretoken.core.queue.scheduler import CurveStepCost, NewRequest
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.fleet import WorkerBook
from foretoken.core.types import (
    LOWER_TIERS,
    CandidatePrediction,
    ModelName,
    Tier,
    WorkerId,
    WorkerProfile,
)

SLOWEST_FIRST: tuple[Tier, ...] = ("SHARED", "DISK", "CPU", "GPU")


@dataclass(frozen=True, slots=True)
class Candidate:
    prediction: CandidatePrediction
    cached_tokens: int


def step_cost(fits: FitRegistry, worker: WorkerId) -> CurveStepCost:
    """The worker's learned cost of an engine step (prefill curve, overhead, decode)."""
    curve = fits.curve(worker)
    step = fits.step_cost(worker)
    return CurveStepCost(curve.cost_s, step.overhead_s, step.per_seq_s)


class Predictions:
    """Every candidate's prediction, from the index, the fits and the worker book."""

    def __init__(
        self, index: Index, fits: FitRegistry, book: WorkerBook, config: PredictorConfig
    ) -> None:
        self.index, self.fits, self.book, self.config = index, fits, book, config

    def candidates(
        self,
        model: ModelName,
        tokens: Sequence[int] | np.ndarray,
        now_s: float,
        prompt_tokens: int | None,
        output_tokens: int = 1,
    ) -> list[Candidate]:
        n = len(tokens) if len(tokens) else (prompt_tokens or 0)
        self.index.age(now_s)  # approximate views forget what their TTL says is gone
        hits = self.index.lookup(model, tokens) if len(tokens) else {}
        return [
            self._one(profile, hits.get(profile.worker_id), n, now_s, output_tokens)
            for profile in self.book.of_model(model)
            if profile.fits_prompt(n)
        ]

    def _one(
        self, profile: WorkerProfile, hit: CacheHit | None, n: int, now_s: float, out: int
    ) -> Candidate:
        wid = profile.worker_id
        cached = min(hit.tokens, n) if hit is not None else 0
        tiers = hit.by_tier() if hit is not None else {}
        load_costs = self.config.tier_load_s_per_token
        load_s = sum(load_costs.get(t, 0.0) * tiers.get(t, 0) for t in LOWER_TIERS)
        deepest = next((t for t in SLOWEST_FIRST if tiers.get(t)), None)
        result = self.book.queues[wid].predict(
            NewRequest(n, cached, out), now_s, step_cost(self.fits, wid)
        )
        prefill = self.fits.curve(wid).own_prefill_s(n, cached) + load_s
        ttft = max(result.ttft_s + load_s, prefill)
        prediction = CandidatePrediction(
            worker_id=wid, predicted_ttft_s=ttft, queue_wait_s=max(0.0, ttft - prefill),
            prefill_s=prefill, cached_tokens=cached, cached_tier=deepest,
            queue_tokens_ahead=result.queue_tokens_ahead,
            approximate_cache=bool(hit is not None and hit.approximate)
            or not profile.has_kv_events,
            cache_source=profile.cache_source,
        )  # fmt: skip
        return Candidate(prediction, cached)
