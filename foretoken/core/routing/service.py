"""The route service's core (pure): :class:`RouteService` answers where a request should go
and whether it may go at all, and learns from what the pipeline observes (PRODUCT.md §1, §3).

It composes parts that each do one thing:

* :class:`~foretoken.core.routing.fleet.WorkerBook` — the workers' profiles and queue models;
* :class:`~foretoken.core.routing.predict.Predictions` — every candidate's predicted TTFT;
* :class:`~foretoken.core.routing.decide.Decider` — choice, admission, Retry-After, explore,
  the latency controls' actions;
* :class:`~foretoken.core.routing.learn.Learner` — fits and approximate cache credit from
  outcomes and graded requests.

A decision is applied to the chosen worker's queue at once (concurrent requests do not herd
onto one idle worker) and remembered by request id (a repeated call gets the same decision;
the grant arriving later on ``grants`` does not count twice). It sees registrations, KV
events (through the index it shares), grants, outcomes and graded requests — what the live
pipeline observes — never a simulator's truth.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from collections.abc import Sequence

import msgspec
import numpy as np

from foretoken.core.cost.quantiles import QuantileConfig, TtftQuantiles
from foretoken.core.cost.registry import FitRegistry
from foretoken.core.index.protocol import Index
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.controls import REJECT_REASON, LatencyControls
from foretoken.core.routing.decide import P90, Decider, decision
from foretoken.core.routing.fleet import WorkerBook
from foretoken.core.routing.learn import Learner
from foretoken.core.routing.outputs import OutputLengths
from foretoken.core.routing.predict import Candidate, Predictions
from foretoken.core.types import (
    GradedRequest,
    KvBatch,
    ModelName,
    RejectReason,
    RequestId,
    RequestOutcome,
    RouteDecision,
    RouteQuery,
    WorkerId,
    WorkerProfile,
)

# First tokens' lateness: a window of this many, its percentile taken every LAG_EVERY.
LAG_WINDOW = 64
LAG_EVERY = 16


class RequestIdReused(ValueError):
    """A route query whose request id names a decision made for another request (another
    model or prompt length): answering it with that decision would place a different
    prompt on the first one's worker, past its admission."""


class RouteService:
    def __init__(
        self,
        index: Index,
        fits: FitRegistry | None = None,
        config: PredictorConfig | None = None,
        controls: LatencyControls | None = None,
    ) -> None:
        self.index = index
        self.controls = controls
        self.fits = fits or FitRegistry()
        self.config = config or PredictorConfig()
        self.book = WorkerBook(model_kv_capacity=self.config.model_kv_capacity)
        self.predictions = Predictions(index, self.fits, self.book, self.config)
        cfg = self.config
        self.quantiles = TtftQuantiles(QuantileConfig(
            window=cfg.quantile_window, pool_window=5 * cfg.quantile_window,
            min_samples=cfg.quantile_min_samples,
            floor_s=cfg.quantile_floor_s, default_factor=cfg.quantile_default_factor,
        ))  # fmt: skip
        self.decider = Decider(self.config, controls, self.book, self.fits, self.quantiles)
        # Admitted decisions whose grant has not come back on `grants` yet: (worker, when).
        self.unconfirmed: OrderedDict[RequestId, tuple[WorkerId, float]] = OrderedDict()
        self.learner = Learner(index, self.fits, self.book, self.config, self.quantiles,
                               self.predictions.tier_costs, self.unconfirmed)  # fmt: skip
        self.decisions: OrderedDict[RequestId, RouteDecision] = OrderedDict()
        self.outputs = OutputLengths(self.config.default_output_tokens,
                                     self.config.decision_memory,
                                     self.config.learn_output_lengths,
                                     self.config.cold_output_tokens)  # fmt: skip
        self.overruled = 0  # our decisions another one replaced (see _withdraw_overruled)
        # Grants naming a worker this service does not know (retired, never registered, or
        # registered after the grant): graded, but in no queue model.
        self.unknown_worker_grants = 0
        self.unconfirmed_expired = 0
        # How late first tokens reach this service (now − their ts), the last LAG_WINDOW:
        # a prefill whose last step ended less than that ago still counts as done.
        self.lags: deque[float] = deque(maxlen=LAG_WINDOW)
        self.lags_noted = 0
        self.lag_s = 0.0

    # ------------------------------------------------------------------ observations

    def on_registration(self, profile: WorkerProfile) -> None:
        if profile.removed:
            self.quantiles.forget(profile.worker_id)
            if self.predictions.wait_scale is not None:
                self.predictions.wait_scale.forget_worker(profile.worker_id)
            self.predictions.tier_costs.forget_worker(profile.worker_id)
            self.predictions.sent.forget_worker(profile.worker_id)
            if self.predictions.overdue is not None:
                self.predictions.overdue.forget_worker(profile.worker_id)
        known = self.book.profiles.get(profile.worker_id)
        if profile.removed or (known is not None and known.config_hash != profile.config_hash):
            self.learner.forget_worker(profile.worker_id)
        self.fits.apply_registration(profile)
        self.book.apply(profile)
        queue = self.book.queues.get(profile.worker_id)
        if queue is not None:  # a new worker's queue model starts with the lag measured
            queue.lag_s = self.lag_s

    def on_grant(self, grant: RouteDecision, now_s: float) -> None:
        """A decision made elsewhere (another replica, the router's fallback) or our own,
        arriving on ``grants``: put it in the queue model unless it is there already."""
        self.unconfirmed.pop(grant.request_id, None)
        if self.predictions.overdue is not None:  # sent for real: its wait is evidence
            self.predictions.overdue.confirm(grant.request_id, grant.worker_id)
        # Only a registered worker's: one per made-up worker id (a stranger's grants) was
        # a track and metric labels for ever, and the controls' timer then blocked the
        # event loop for seconds at every tick.
        if self.controls is not None and grant.worker_id in self.book.queues:
            self.controls.observe_grant(grant, now_s)
        self._withdraw_overruled(grant, now_s)
        if grant.admitted and grant.worker_id is not None:
            if grant.worker_id not in self.book.queues:
                self.unknown_worker_grants += 1
            self.outputs.sent(grant.request_id, grant.model, grant.expected_output_tokens)
            expected = self.outputs.expected(grant.model, grant.expected_output_tokens)
            tail = self.outputs.tail(grant.model, grant.expected_output_tokens)
            self.book.enqueue(grant.worker_id, grant.request_id, grant.ts, grant.prompt_tokens,
                              grant.cached_tokens, expected, tail=tail)  # fmt: skip

    def _withdraw_overruled(self, grant: RouteDecision, now_s: float) -> None:
        """Our decision for this request was not the one the router used (it timed out and
        asked another replica, or fell back): the request never goes to the worker we put it
        on, so it leaves that queue model now instead of haunting it until it expires."""
        ours = self.decisions.get(grant.request_id)
        if ours is None or ours is grant or ours.worker_id is None:
            return
        if grant.admitted and grant.worker_id == ours.worker_id:
            return
        queue = self.book.queues.get(ours.worker_id)
        if queue is not None and queue.finished(grant.request_id, now_s):
            self.book.withdraw(grant.request_id)
            self._forget(grant.request_id)
        self.decisions[grant.request_id] = grant
        self.overruled += 1

    def _forget(self, rid: RequestId) -> None:
        """``rid`` left its queue model without an outcome (expired, overruled, never
        acted on)."""
        self.learner.forget(rid)
        self.predictions.sent.release(rid)
        if self.predictions.overdue is not None:
            self.predictions.overdue.done(rid)

    def use_index(self, index: Index) -> None:
        """Read another index from now on (a route replica restored from a newer snapshot
        at a rebalance); the fits, queue models and decisions stay."""
        self.index = index
        self.predictions.index = index
        self.learner.index = index

    def on_outcome(self, outcome: RequestOutcome, now_s: float) -> None:
        self.predictions.health.observe(outcome, now_s)
        if self.controls is not None:
            self.controls.observe_outcome(outcome, now_s)
        scale = self.predictions.wait_scale
        if outcome.kind == "first_token":
            self._note_lag(now_s - outcome.ts)
        if outcome.kind == "first_token" and outcome.actual_ttft_s is not None:
            self._residual(outcome, outcome.actual_ttft_s)
            if outcome.status == "ok":
                self.outputs.started(outcome.request_id, outcome.ts)
            if scale is not None and outcome.status == "ok":
                known = self.decisions.get(outcome.request_id)
                waited = known.already_waited_s if known is not None else 0.0
                scale.first_token(outcome.request_id, outcome.worker_id,
                                  max(0.0, outcome.actual_ttft_s - waited))  # fmt: skip
        sent = self.predictions.sent
        if (
            outcome.status != "ok"
            or outcome.kind == "completion"
            or sent.worker_of(outcome.request_id) not in (None, outcome.worker_id)
        ):
            sent.release(outcome.request_id)  # done (its blocks are the index's), or elsewhere
        if self.predictions.overdue is not None:
            self.predictions.overdue.done(outcome.request_id)  # no longer waiting
        if outcome.status != "ok" or outcome.kind == "completion":
            self.quantiles.drop(outcome.request_id)  # no residual will come (or it came)
            if scale is not None:
                scale.forget(outcome.request_id)
        if outcome.status != "ok":
            self.outputs.forget(outcome.request_id)
        elif outcome.kind == "completion" and outcome.output_tokens:
            revision = self.outputs.revision
            streamed = (outcome.e2e_s - outcome.actual_ttft_s
                        if outcome.e2e_s is not None and outcome.actual_ttft_s is not None
                        else None)  # fmt: skip
            self.outputs.completed(outcome.request_id, outcome.output_tokens, outcome.ts,
                                   streamed)  # fmt: skip
            if self.outputs.revision != revision:
                self.book.reestimate(self.outputs.expected_for, self.outputs.tail_for)
        self.learner.on_outcome(outcome, now_s)

    def on_kv_batch(self, batch: KvBatch, now_s: float) -> None:
        """A worker's KV batch, after the index took it: what it says of a prefill's pace."""
        self.learner.on_kv_batch(batch, now_s)

    def _note_lag(self, lag_s: float) -> None:
        """One more first token's lateness; every LAG_EVERY of them the queue models take
        the window's 90th percentile (at most ``max_first_token_lag_s``) as their grace."""
        self.lags.append(min(max(lag_s, 0.0), self.config.max_first_token_lag_s))
        self.lags_noted += 1
        if self.lags_noted % LAG_EVERY:
            return
        ordered = sorted(self.lags)
        self.lag_s = ordered[int(0.9 * (len(ordered) - 1))]
        for queue in self.book.queues.values():
            queue.lag_s = self.lag_s

    def _residual(self, outcome: RequestOutcome, actual_s: float) -> None:
        """A first token of a request decided here: its residual for the quantiles now."""
        known = self.decisions.get(outcome.request_id)
        if known is None or known.worker_id != outcome.worker_id or outcome.status != "ok":
            return
        if known.predicted_ttft_s is None or known.fallback:
            return
        default = known.fit.default if known.fit is not None else None
        # the router's TTFT counts the time the client waited before this attempt; the
        # prediction is the attempt's
        attempt_s = max(0.0, actual_s - known.already_waited_s)
        self.quantiles.observe(outcome.request_id, outcome.worker_id, known.predicted_ttft_s,
                               attempt_s, known.queue_wait_s, default)  # fmt: skip

    def on_graded(self, graded: GradedRequest, now_s: float) -> bool:
        """Feed the fits with a cold sample; True if this record was one."""
        return self.learner.on_graded(graded, now_s)

    def maintain(self, now_s: float) -> None:
        if self.controls is not None:
            self.controls.tick(now_s)
        for rid in self.book.expire(now_s, self.config.outstanding_max_age_s):
            self._forget(rid)
        self._expire_unconfirmed(now_s)
        self.index.age(now_s)

    def _expire_unconfirmed(self, now_s: float) -> None:
        """Decisions nobody acted on (their grant never came) leave the queue models: a
        caller that only asks must not make idle workers look deep."""
        horizon = self.config.unconfirmed_decision_s
        while self.unconfirmed:
            rid, (wid, decided_s) = next(iter(self.unconfirmed.items()))
            if now_s - decided_s <= horizon:
                return
            del self.unconfirmed[rid]
            queue = self.book.queues.get(wid)
            if queue is not None and queue.finished(rid, now_s):
                self.unconfirmed_expired += 1
            self.book.withdraw(rid)
            self._forget(rid)

    # ------------------------------------------------------------------ predictions

    def predict(
        self, model: ModelName, tokens: Sequence[int] | np.ndarray, now_s: float,
        prompt_tokens: int | None = None, output_tokens: int | None = None,
        cache_salt: str | None = None, lora_name: str | None = None,
    ) -> list[Candidate]:  # fmt: skip
        out = self.outputs.expected(model, output_tokens)
        return self.predictions.candidates(model, tokens, now_s, prompt_tokens, out, cache_salt,
                                           lora_name)  # fmt: skip

    # ------------------------------------------------------------------ decisions

    def route(self, query: RouteQuery, now_s: float, ts: float) -> RouteDecision:
        known = self.decisions.get(query.request_id)
        if known is not None:  # a retry of a request placed already: the same answer
            if known.model != query.model or known.prompt_tokens != query.prompt_length:
                raise RequestIdReused(
                    f"request id {query.request_id!r} was decided for another request "
                    f"({known.model}, {known.prompt_tokens} prompt tokens)"
                )
            return known
        if self.controls is not None:
            self.controls.tick(now_s)
            query = self._with_class_defaults(query)
        candidates = self.predict(query.model, query.tokens, now_s, query.prompt_tokens,
                                  query.expected_output_tokens, query.cache_salt,
                                  query.lora_name)  # fmt: skip
        if not candidates:
            return self._remember(self._no_candidate(query, ts))
        result = self._decide(query, candidates, now_s, ts)
        # The latency controls see the decision when its grant comes back on ``grants``
        # (on_grant): only a request the router acted on reaches an engine.
        if result.admitted and result.worker_id is not None:
            chosen = next(c for c in candidates if c.prediction.worker_id == result.worker_id)
            self._apply(query, result, now_s, chosen)
            self.unconfirmed[query.request_id] = (result.worker_id, now_s)
            if len(self.unconfirmed) > self.config.decision_memory:
                self.unconfirmed.popitem(last=False)
        return self._remember(result)

    def _decide(
        self, query: RouteQuery, candidates: list[Candidate], now_s: float, ts: float
    ) -> RouteDecision:
        decider = self.decider
        decider.now_s = now_s
        best = decider.choose(query, candidates)
        first = best.prediction.worker_id
        best, shed = decider.controlled(query, best, candidates, now_s)
        admitted, reason = decider.admit(query, best)
        explore = False
        retry_after = None
        if shed and self.controls is not None:
            admitted, reason = False, REJECT_REASON
            retry_after = self.controls.settings.admission_retry_after_s
        elif not admitted:
            if reason != RejectReason.PREFILL_EXCEEDS_BOUND:
                retry_after = decider.retry_after(query, best)
            if decider.explore():
                admitted, explore = True, True
        result = decision(
            query, ts, best, admitted=admitted, reason=reason, retry_after_s=retry_after,
            fits=self.fits, explore=explore, candidates=tuple(c.prediction for c in candidates),
            p90_s=decider.upper(best, P90),
        )  # fmt: skip
        if best.prediction.worker_id != first and admitted:
            result = msgspec.structs.replace(result, rerouted_from=first)
        return result

    def _apply(
        self, query: RouteQuery, result: RouteDecision, now_s: float, chosen: Candidate
    ) -> None:
        """An admitted decision enters the chosen worker's queue model at once, and its
        prompt the worker's held prefixes."""
        wid = result.worker_id
        assert wid is not None
        self.outputs.sent(query.request_id, query.model, query.expected_output_tokens)
        expected = self.outputs.expected(query.model, query.expected_output_tokens)
        tail = self.outputs.tail(query.model, query.expected_output_tokens)
        self.book.enqueue(wid, query.request_id, now_s, query.prompt_length,
                          result.cached_tokens, expected, chosen.pinned_tokens, tail)  # fmt: skip
        if chosen.chain is not None:
            self.predictions.sent.add(query.request_id, wid, chosen.chain)
            self.learner.remember_prompt(query.request_id, wid, chosen.chain)
        if chosen.lower is not None:  # a credit from one lower tier: a sample of its cost
            self.learner.remember_tier(query.request_id, wid, chosen.lower)
        self.decider.remember_conversation(query, wid)
        if result.predicted_ttft_s is not None and not result.fallback:
            self.note_prediction(query.request_id, wid, result.predicted_ttft_s,
                                 result.queue_wait_s)  # fmt: skip
            default = result.fit.default if result.fit is not None else None
            self.quantiles.sent(query.request_id, wid, result.predicted_ttft_s,
                                result.queue_wait_s, default, now_s)  # fmt: skip
            overdue = self.predictions.overdue
            if default and overdue is not None:
                overdue.sent(query.request_id, wid, now_s, result.predicted_ttft_s)

    def note_prediction(self, rid: RequestId, wid: WorkerId, predicted_ttft_s: float,
                        queue_wait_s: float | None) -> None:  # fmt: skip
        """``rid`` goes to ``wid`` with this prediction of ours (our decision, or, on a read
        replica, what we predicted for the worker another router chose): its first token
        will say how far the walk's queue wait was off (the wait scale)."""
        scale = self.predictions.wait_scale
        if scale is not None and queue_wait_s is not None:
            raw = scale.raw(wid, queue_wait_s)
            scale.decided(rid, wid, raw, predicted_ttft_s - queue_wait_s)

    def _no_candidate(self, query: RouteQuery, ts: float) -> RouteDecision:
        """No worker of the model can hold the prompt, or none serves the model (or the
        LoRA adapter it names: a router whose engines file has it falls back to its own)."""
        lora = query.lora_name
        serving = any(lora in p.lora_adapters for p in self.book.of_model(query.model))
        if self.book.serves(query.model) and (lora is None or serving):
            reason, retry = RejectReason.PROMPT_EXCEEDS_KV_CAPACITY, None
        else:
            reason, retry = RejectReason.NO_WORKER_FOR_MODEL, self.config.max_retry_after_s
        return decision(query, ts, None, admitted=False, reason=reason, retry_after_s=retry)

    def _with_class_defaults(self, query: RouteQuery) -> RouteQuery:
        """The class's name as configured (unknown → default) and its default bound."""
        assert self.controls is not None
        name, klass = self.controls.resolve(query.workload_class)
        bound = query.max_queue_wait_s
        if bound is None:
            bound = klass.max_queue_wait_s
        if name == query.workload_class and bound == query.max_queue_wait_s:
            return query
        return dataclasses.replace(query, workload_class=name, max_queue_wait_s=bound)

    def _remember(self, result: RouteDecision) -> RouteDecision:
        self.decisions[result.request_id] = result
        if len(self.decisions) > self.config.decision_memory:
            self.decisions.popitem(last=False)
        return result
