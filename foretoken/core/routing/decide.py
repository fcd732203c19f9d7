"""Decisions on top of the predictions (PRODUCT.md §3 "Route service"):

* choice: the lowest predicted TTFT; a conversation stays on its previous worker while that
  costs at most ``stickiness_margin_s`` more than the best alternative (its history is
  cached there: moving means a cold prefill elsewhere); a client that prefers cache hits
  gets the worker with the most cached tokens among those that meet its bound; an idle
  worker still on the default curve takes the request so that it learns (the *learner*
  rule);
* admission: with a bound B (``max_queue_wait_s``), admitted iff already waited + predicted
  TTFT ≤ B; without a bound, rejected only when even the best worker's predicted queue wait
  exceeds ``overload_wait_s`` (severe overload);
* Retry-After: when the best worker's queue will have drained enough for the request to fit
  its bound (the excess of the predicted wait over what the bound leaves), clamped; none
  when waiting cannot help (the request's own prefill exceeds its bound);
* explore: a configured fraction of would-be rejections is admitted anyway and flagged, so
  that false alarms can be measured directly;
* latency controls (:mod:`foretoken.core.routing.controls`): when the class is at reroute
  (or shed) on the chosen worker, the request moves to the best *verified* alternative
  (healthy for the class, same model, capacity, projected latency within the class's
  budget), else stays; when the class is still shed there, it is rejected;
* replica shares: with several route replicas deciding at once, each sees the others'
  decisions only when their grants arrive; replica ``i`` of ``n`` (a :class:`ReplicaShare`)
  prefers, among the candidates within ``replica_tie_margin_s`` of the best (and admitted
  wherever the best would be), the workers it owns — every ``n``-th of the candidates
  sorted by worker id — so that two replicas deciding within that staleness do not pick the
  same idle worker. No share (one replica) decides exactly as before.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass

from foretoken.core.checks import MAX_PREDICTED_S
from foretoken.core.cost.quantiles import TtftQuantiles
from foretoken.core.cost.registry import FitRegistry
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.controls import LatencyControls
from foretoken.core.routing.fleet import WorkerBook
from foretoken.core.routing.predict import Candidate
from foretoken.core.types import (
    CacheSource,
    CandidatePrediction,
    RejectReason,
    RouteDecision,
    RouteQuery,
    WorkerId,
)


@dataclass(frozen=True, slots=True)
class ReplicaShare:
    """Replica ``index`` of ``count`` route replicas answering for the same models."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"replica index {self.index} not within 0..{self.count - 1}")

    def owned(self, candidates: list[Candidate]) -> set[WorkerId]:
        """The workers of this share: every ``count``-th by id, from position ``index``."""
        ids = sorted(c.prediction.worker_id for c in candidates)
        return {w for i, w in enumerate(ids) if i % self.count == self.index}


P90: float = 0.9  # the quantile every grant carries


class Decider:
    def __init__(
        self, config: PredictorConfig, controls: LatencyControls | None, book: WorkerBook,
        fits: FitRegistry, quantiles: TtftQuantiles | None = None,
    ) -> None:  # fmt: skip
        self.config, self.controls, self.book, self.fits = config, controls, book, fits
        self.quantiles = quantiles or TtftQuantiles()
        self.rng = random.Random(config.seed)
        self.conversations: OrderedDict[str, WorkerId] = OrderedDict()
        # Set by the processor from the members it sees (None: one replica, no share).
        self.share: ReplicaShare | None = None
        self.share_moves = 0  # decisions that took an owned near-tie over the best
        # The clock of the decision in progress (set by the route service): the quantiles
        # count the censored residuals of requests still waiting at that time.
        self.now_s: float | None = None

    # ------------------------------------------------------------------ choice

    def choose(self, query: RouteQuery, candidates: list[Candidate]) -> Candidate:
        def key(c: Candidate) -> tuple[float, int]:
            return (c.prediction.predicted_ttft_s, c.prediction.queue_tokens_ahead)

        weight = self.config.placement_delay_weight

        def placed(c: Candidate) -> tuple[float, int]:  # its TTFT and what it costs others
            return (c.prediction.predicted_ttft_s + weight * c.delay_s,
                    c.prediction.queue_tokens_ahead)  # fmt: skip

        best = min(candidates, key=placed)
        learner = self._learner(query, candidates)
        if learner is not None:
            return learner
        if query.prefer_cache_hit:
            fits = [c for c in candidates if self.meets(query, c)] or [best]
            return max(fits, key=lambda c: (c.cached_tokens, -key(c)[0]))
        conv = query.conversation_id
        sticky = self.conversations.get(conv) if conv else None
        if sticky is not None:
            mine = next((c for c in candidates if c.prediction.worker_id == sticky), None)
            margin = self.config.stickiness_margin_s
            if mine is not None and mine.prediction.predicted_ttft_s <= key(best)[0] + margin:
                return mine
        return self._shared(query, candidates, best)

    def _sharing(self) -> ReplicaShare | None:
        share = self.share
        if share is None or share.count < 2 or self.config.replica_tie_margin_s <= 0:
            return None
        return share

    def _shared(self, query: RouteQuery, candidates: list[Candidate], best: Candidate) -> Candidate:
        """Among the near-ties of ``best``, one of this replica's share (see the module)."""
        share = self._sharing()
        if share is None:
            return best
        owned = share.owned(candidates)
        if best.prediction.worker_id in owned:
            return best
        limit = best.prediction.predicted_ttft_s + self.config.replica_tie_margin_s
        admitted = self.admit(query, best)[0]  # a share never turns an admission into a 429
        near = [
            c for c in candidates
            if c.prediction.worker_id in owned and c.prediction.predicted_ttft_s <= limit
            and (not admitted or self.admit(query, c)[0])
        ]  # fmt: skip
        if not near:
            return best
        self.share_moves += 1
        return min(near, key=lambda c: (c.prediction.predicted_ttft_s,
                                        c.prediction.queue_tokens_ahead))  # fmt: skip

    def _learner(self, query: RouteQuery, candidates: list[Candidate]) -> Candidate | None:
        """An idle worker without a cold fit yet takes the request (if it meets its
        bound there): the default is deliberately pessimistic, so without this such a worker
        would never be chosen and never learn its curve (its first samples are cheap: it is
        idle, and a prefill sample needs an idle worker). A pooled or busy-chain curve is
        only a bootstrap: the rule holds until the worker's own cold fit is ready. Not when
        most of the prompt is cached somewhere: throwing a large hit away costs more than
        the sample is worth."""
        n = query.prompt_length
        share = self.config.learner_max_cached_share
        if any(c.cached_tokens * share > n for c in candidates):
            return None
        replicas = self._sharing()
        if replicas is not None:  # this replica's own learners first, the others after
            owned = replicas.owned(candidates)
            candidates = sorted(candidates, key=lambda c: c.prediction.worker_id not in owned)
        for c in candidates:
            wid = c.prediction.worker_id
            if self.book.idle(wid) and not self.fits.has_cold_fit(wid) and self.meets(query, c):
                return c
        return None

    def remember_conversation(self, query: RouteQuery, wid: WorkerId) -> None:
        if not query.conversation_id:
            return
        self.conversations[query.conversation_id] = wid
        self.conversations.move_to_end(query.conversation_id)
        if len(self.conversations) > self.config.conversation_memory:
            self.conversations.popitem(last=False)

    # ------------------------------------------------------------------ controls

    def controlled(
        self, query: RouteQuery, best: Candidate, candidates: list[Candidate], now_s: float
    ) -> tuple[Candidate, bool]:
        """The latency controls' say: a verified alternative when the class must leave the
        chosen worker, and whether admission control sheds the request where it lands."""
        controls = self.controls
        if controls is None:
            return best, False
        name, klass = controls.resolve(query.workload_class)
        wid = best.prediction.worker_id
        if controls.avoid(name, wid) or controls.sheds(name, wid, now_s):
            verified = [
                c for c in candidates
                if c.prediction.worker_id != wid
                and controls.healthy(name, c.prediction.worker_id, now_s)
                and self.book.has_capacity(c.prediction.worker_id)
                and c.prediction.queue_wait_s <= klass.queue_budget_s
                and query.already_waited_s + c.prediction.predicted_ttft_s
                <= klass.objective_ttft_s - klass.margin_s
            ]  # fmt: skip
            if verified:
                best = min(verified, key=lambda c: c.prediction.predicted_ttft_s)
            elif controls.sheds(name, wid, now_s):
                best = self._servable(query, name, best, candidates, now_s)
        return best, controls.sheds(name, best.prediction.worker_id, now_s)

    def _servable(
        self, query: RouteQuery, name: str, best: Candidate, candidates: list[Candidate],
        now_s: float,
    ) -> Candidate:  # fmt: skip
        """When admission control sheds the class on the chosen worker and no verified
        alternative exists, any worker that does not shed it, has room and meets the
        request's own bound serves it rather than a 429: one worker's state (stuck
        accounting included) never turns away traffic a healthy worker can take."""
        assert self.controls is not None
        wid = best.prediction.worker_id
        able = [
            c for c in candidates
            if c.prediction.worker_id != wid
            and not self.controls.sheds(name, c.prediction.worker_id, now_s)
            and self.book.has_capacity(c.prediction.worker_id)
            and self.admit(query, c)[0]
        ]  # fmt: skip
        return min(able, key=lambda c: c.prediction.predicted_ttft_s) if able else best

    # ------------------------------------------------------------------ admission

    def upper(self, c: Candidate, q: float) -> float:
        """The calibrated q-quantile of the candidate's TTFT."""
        p = c.prediction
        default = self.fits.curve(p.worker_id).default
        return self.quantiles.upper(p.worker_id, p.predicted_ttft_s, q, p.queue_wait_s, default,
                                    self.now_s)  # fmt: skip

    def meets(self, query: RouteQuery, c: Candidate) -> bool:
        """Whether the candidate meets the request's bound: its predicted TTFT, or with
        ``admission_quantile`` = q its predicted q-quantile (P(TTFT <= B) >= q)."""
        if query.max_queue_wait_s is None:
            return True
        q = self.config.admission_quantile
        ttft = c.prediction.predicted_ttft_s if q is None else self.upper(c, q)
        return query.already_waited_s + ttft <= query.max_queue_wait_s

    def admit(self, query: RouteQuery, best: Candidate) -> tuple[bool, RejectReason]:
        if query.max_queue_wait_s is not None:
            if query.already_waited_s + best.prediction.prefill_s > query.max_queue_wait_s:
                return False, RejectReason.PREFILL_EXCEEDS_BOUND  # waiting cannot help
            return self.meets(query, best), RejectReason.PREDICTED_TTFT_EXCEEDS_BOUND
        ok = best.prediction.queue_wait_s <= self.config.overload_wait_s
        return ok, RejectReason.OVERLOADED

    def retry_after(self, query: RouteQuery, best: Candidate) -> float:
        p = best.prediction
        if query.max_queue_wait_s is not None:
            q = self.config.admission_quantile
            ttft = p.predicted_ttft_s if q is None else self.upper(best, q)
            excess = query.already_waited_s + ttft - query.max_queue_wait_s
        else:
            excess = p.queue_wait_s - self.config.overload_wait_s
        wait = min(excess, p.queue_wait_s) if p.queue_wait_s > 0 else excess
        return min(max(wait, self.config.min_retry_after_s), self.config.max_retry_after_s)

    def explore(self) -> bool:
        """Whether this would-be rejection is admitted anyway (one draw per rejection)."""
        return self.rng.random() < self.config.explore_fraction


def decision(
    query: RouteQuery, ts: float, best: Candidate | None, *, admitted: bool,
    reason: str | None, retry_after_s: float | None, fits: FitRegistry | None = None,
    explore: bool = False, candidates: tuple[CandidatePrediction, ...] = (),
    fallback: bool = False, worker_id: WorkerId | None = None, p90_s: float | None = None,
) -> RouteDecision:  # fmt: skip
    """The one builder of a decision (the route service's, and the router's fallback, which
    names ``worker_id`` without a prediction)."""
    p = best.prediction if best is not None else None
    fit = fits.curve(p.worker_id).to_fit_used() if p is not None and fits is not None else None
    chosen = p.worker_id if p is not None else worker_id
    return RouteDecision(
        request_id=query.request_id, ts=ts, model=query.model,
        workload_class=query.workload_class, prompt_tokens=query.prompt_length,
        worker_id=chosen if admitted else None, admitted=admitted,
        reject_reason=None if admitted else reason,
        retry_after_s=None if retry_after_s is None else round(retry_after_s, 3),
        predicted_ttft_s=p.predicted_ttft_s if p else None,
        predicted_ttft_p90_s=None if p is None or p90_s is None else round(p90_s, 4),
        queue_wait_s=_part(p.queue_wait_s) if p else None,
        prefill_s=_part(p.prefill_s) if p else None,
        cached_tokens=p.cached_tokens if p else 0, cached_tier=p.cached_tier if p else None,
        approximate_cache=p.approximate_cache if p else False,
        cache_source=p.cache_source if p else CacheSource.EVENTS,
        queue_tokens_ahead=p.queue_tokens_ahead if p else 0, fit=fit,
        max_queue_wait_s=query.max_queue_wait_s, already_waited_s=query.already_waited_s,
        explore=explore, fallback=fallback, conversation_id=query.conversation_id,
        expected_output_tokens=query.expected_output_tokens, candidates=candidates,
    )  # fmt: skip


def _part(seconds: float) -> float:
    """A prediction's part as a decision may carry it (a poisoned queue model's astronomic
    wait must not make the decision itself invalid: the route call would fail)."""
    return min(max(seconds, 0.0), MAX_PREDICTED_S)
