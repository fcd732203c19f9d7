"""The processor's core as a routing policy, so that a virtual-time replay measures it.

:class:`PredictorPolicy` runs the processor's core exactly as the live processor builds it
(:func:`foretoken.compose.build_core`: cache index, fits, route service, latency controls,
grading join) and feeds it what the live pipeline would, in the order it would, on one
clock (the replay's virtual seconds):

* **registrations**: what each engine reports about itself (its
  :class:`~foretoken.core.types.WorkerProfile`: model, engine and version, block size,
  scheduler settings, KV hash algorithm, tiers, EAGLE, GPU blocks, config hash) — never a
  simulated engine's hidden ``truth``; the index registers each worker as the processor's
  index keeper does;
* **KV events** as :class:`~foretoken.core.types.KvBatch` values (one per delivery,
  ``seq`` counting per worker), as ingest writes them and the index agent applies them;
* **grants**: its own decisions (the route service's ``route``, then ``on_grant``, which
  is idempotent, as when the grant comes back on ``grants``) and the grading join;
* **outcomes** shaped as the router publishes them: a ``first_token`` outcome with the
  TTFT, then a ``completion`` with the engine-reported cached tokens, output tokens,
  end-to-end time and error;
* **graded** requests from the real grading join, so the fits learn from the cold samples
  the live predictor would learn from.

The live pipeline delivers graded records a little later than the completion; here they
are delivered at once (the replay has no broker lag). Join and queue expiry run every
``join.expiry_interval_s`` virtual seconds, as the processor's timer does.

The decision carries the prediction (predicted TTFT, queue wait, own prefill, credited
cached tokens and tier, queued tokens ahead, fit, candidates, explore), so the replay's
records grade it. Registered as ``"predictor"``.

:class:`ApproxPredictorPolicy` (``"predictor-approx"``) is the same predictor for engines
that publish no KV events and report no cached tokens: every worker registers with
``has_kv_events = reports_cached_tokens = False``, the replay builds no KV events, the index
credits routed prompts only (:mod:`foretoken.core.index.approx`), and the engines' cached
tokens are withheld from the predictor. The replay's own records still carry what the
simulated engine reused, so its cache disagreement measures how far the approximate credit
is off.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Self

import msgspec
import numpy as np

from foretoken.compose import build_core
from foretoken.core.index.protocol import Index
from foretoken.core.routing.classes import ControlSettings
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.service import RouteService
from foretoken.core.types import (
    CandidatePrediction,
    GradedRequest,
    KvBatch,
    KvEvent,
    RequestId,
    RequestOutcome,
    RouteDecision,
    RouteQuery,
    WorkerId,
    WorkerProfile,
)
from foretoken.settings import Settings
from foretoken.sim.policy import (
    Arrival,
    Decision,
    FinishedSeen,
    FirstTokenSeen,
    FleetView,
    register_policy,
)
from foretoken.sim.prefix_cache import KvEventDetail, TokenIds
from foretoken.sim.spec import FleetSpec

POLICY_NAME = "predictor"
APPROX_POLICY_NAME = "predictor-approx"
REASON_ADMITTED = "lowest_predicted_ttft"
REASON_EXPLORE = "explore"


def _token_tuple(token_ids: TokenIds | None) -> tuple[int, ...]:
    if token_ids is None:
        return ()
    if isinstance(token_ids, np.ndarray):
        return tuple(token_ids.tolist())
    return tuple(int(t) for t in token_ids)


@dataclass(slots=True)
class PolicyCounters:
    """What the policy fed the predictor (for benchmarks and tests)."""

    decisions: int = 0
    kv_batches: int = 0
    outcomes: int = 0
    graded: int = 0
    cold_samples: int = 0  # graded records the fits took as prefill samples
    rerouted: int = 0  # decisions the latency controls moved off the first choice


class PredictorPolicy:
    """A :class:`~foretoken.sim.policy.RoutingPolicy` backed by the processor's core
    (:func:`foretoken.compose.build_core`, as the live processor builds it)."""

    name = POLICY_NAME
    kv_events: KvEventDetail = "full"

    def __init__(
        self,
        fleet: FleetView,
        seed: int = 0,
        *,
        settings: Settings | None = None,
        config: PredictorConfig | None = None,
        controls: ControlSettings | None = None,
    ) -> None:
        """``settings``: the predictor, fits and join configuration (defaults otherwise);
        ``config`` overrides its predictor part; ``controls``: run the latency controls
        with these classes in virtual time (None: without them)."""
        settings = settings or Settings()
        base = replace(config or settings.predictor, seed=seed)  # the policy's seed wins
        self.core = build_core(settings, predictor=base, controls=controls,
                               with_controls=controls is not None)  # fmt: skip
        self.counters = PolicyCounters()
        self._maintain_every_s = settings.join.expiry_interval_s
        self._next_maintain_s = self._maintain_every_s
        self._kv_seq: dict[WorkerId, int] = {}
        self._ttft: dict[RequestId, float] = {}
        self._cached: dict[RequestId, int | None] = {}
        for profile in fleet.workers:
            self.register(profile)

    @property
    def service(self) -> RouteService:
        return self.core.service

    @property
    def index(self) -> Index:
        return self.core.index

    @classmethod
    def for_fleet(
        cls,
        fleet: FleetSpec,
        seed: int = 0,
        *,
        settings: Settings | None = None,
        config: PredictorConfig | None = None,
        controls: ControlSettings | None = None,
    ) -> Self:
        """A policy for a simulated fleet, registered from each engine's reported fields
        (never its truth); with ``controls``, the latency controls run in virtual time."""
        view = FleetView([spec.profile() for spec in fleet.engines])
        return cls(view, seed, settings=settings, config=config, controls=controls)

    # ------------------------------------------------------------------ observations

    def register(self, profile: WorkerProfile) -> None:
        """A ``workers`` record: to the index (as the index keeper does) and the service."""
        self.core.register(profile)

    def on_kv_events(self, worker_id: WorkerId, events: Sequence[KvEvent], t_s: float) -> None:
        profile = self.core.directory.get(worker_id)
        if profile is None or not events:
            return
        seq = self._kv_seq.get(worker_id, 0)
        self._kv_seq[worker_id] = seq + 1
        batch = KvBatch(worker_id=worker_id, model=profile.model, seq=seq, ts=t_s,
                        events=tuple(events))  # fmt: skip
        self.core.index.apply(batch, t_s)
        self.core.service.on_kv_batch(batch, t_s)
        self.counters.kv_batches += 1
        self._maintain(t_s)

    def on_first_token(self, seen: FirstTokenSeen) -> None:
        # The router's first-token outcome carries the TTFT; the cached tokens come with
        # the completion (the engine's usage block).
        self._ttft[seen.request_id] = seen.ttft_s
        self._cached[seen.request_id] = seen.engine_cached_tokens
        outcome = RequestOutcome(request_id=seen.request_id, ts=seen.t_s, kind="first_token",
                                 worker_id=seen.worker_id, actual_ttft_s=seen.ttft_s)  # fmt: skip
        self._outcome(outcome, seen.t_s)

    def on_finished(self, seen: FinishedSeen) -> None:
        outcome = RequestOutcome(
            request_id=seen.request_id, ts=seen.t_s, kind="completion", worker_id=seen.worker_id,
            status="ok" if seen.error is None else "error",
            actual_ttft_s=self._ttft.pop(seen.request_id, None),
            engine_cached_tokens=self._cached.pop(seen.request_id, None),
            output_tokens=seen.output_tokens, e2e_s=seen.e2e_s, error=seen.error,
            decode_step_s=seen.decode_step_s,
        )  # fmt: skip
        self._outcome(outcome, seen.t_s)

    def _outcome(self, outcome: RequestOutcome, t_s: float) -> None:
        self.counters.outcomes += 1
        self._graded(self.core.on_outcome(outcome, t_s), t_s)
        self._maintain(t_s)

    def _graded(self, records: list[GradedRequest], t_s: float) -> None:
        for graded in records:
            self.counters.graded += 1
            if self.core.on_graded(graded, t_s):
                self.counters.cold_samples += 1

    def _maintain(self, t_s: float) -> None:
        controls = self.core.controls
        if controls is not None:  # the processor's controls timer (self-throttled)
            controls.tick(t_s)
        if t_s < self._next_maintain_s:
            return
        self._next_maintain_s = t_s + self._maintain_every_s
        self._graded(self.core.expire(t_s), t_s)

    # ------------------------------------------------------------------ decisions

    def _query(self, request: Arrival) -> RouteQuery:
        return RouteQuery(
            request_id=request.request_id, model=request.model,
            tokens=_token_tuple(request.token_ids), prompt_tokens=max(request.prompt_tokens, 1),
            max_queue_wait_s=request.max_queue_wait_s, already_waited_s=request.already_waited_s,
            workload_class=request.workload_class, conversation_id=request.conversation_id,
            expected_output_tokens=request.max_tokens,
        )  # fmt: skip

    def decide(self, request: Arrival, fleet: FleetView) -> Decision:
        now_s = request.arrival_s
        self._maintain(now_s)
        grant = self.core.service.route(self._query(request), now_s, now_s)
        self.counters.decisions += 1
        self.counters.rerouted += grant.rerouted_from is not None
        self.on_grant(grant, now_s)
        return decision_from_grant(grant)

    def on_grant(self, grant: RouteDecision, t_s: float) -> None:
        """A grant as it arrives on ``grants``: its own (a no-op for the queues, which took
        it at decision time) or another router's or replica's, as a read replica
        follows the decisions it did not make. Into the queue model and the join."""
        self._graded(self.core.on_grant(grant, t_s), t_s)

    def predict_on(self, request: Arrival, worker_id: WorkerId) -> CandidatePrediction | None:
        """This predictor's prediction for ``request`` on one worker, without deciding
        (None when that worker is not a candidate)."""
        tokens = _token_tuple(request.token_ids)
        for candidate in self.core.service.predict(
            request.model, tokens, request.arrival_s, request.prompt_tokens, request.max_tokens
        ):
            if candidate.prediction.worker_id == worker_id:
                return candidate.prediction
        return None


def _finite_or_none(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


def decision_from_grant(grant: RouteDecision) -> Decision:
    """The policy decision of a predictor grant, with its whole prediction."""
    if grant.admitted:
        reason = REASON_EXPLORE if grant.explore else REASON_ADMITTED
    else:
        reason = grant.reject_reason or "rejected"
    return Decision(
        worker_id=grant.worker_id if grant.admitted else None,
        reason=reason,
        retry_after_s=_finite_or_none(grant.retry_after_s),
        predicted_ttft_s=_finite_or_none(grant.predicted_ttft_s),
        predicted_ttft_p90_s=_finite_or_none(grant.predicted_ttft_p90_s),
        queue_wait_s=_finite_or_none(grant.queue_wait_s),
        prefill_s=_finite_or_none(grant.prefill_s),
        cached_tokens=grant.cached_tokens,
        cached_tier=grant.cached_tier,
        queue_tokens_ahead=grant.queue_tokens_ahead,
        fit=grant.fit,
        explore=grant.explore,
        candidates=grant.candidates,
    )


class ApproxPredictorPolicy(PredictorPolicy):
    """The predictor on engines without KV events or cached-token reports (module doc)."""

    name = APPROX_POLICY_NAME
    kv_events: KvEventDetail = "off"

    def register(self, profile: WorkerProfile) -> None:
        if not profile.removed:
            profile = msgspec.structs.replace(
                profile, has_kv_events=False, reports_cached_tokens=False
            )
        super().register(profile)

    def on_first_token(self, seen: FirstTokenSeen) -> None:
        super().on_first_token(replace(seen, engine_cached_tokens=None))  # the engine says nothing


register_policy(POLICY_NAME, PredictorPolicy)
register_policy(APPROX_POLICY_NAME, ApproxPredictorPolicy)
