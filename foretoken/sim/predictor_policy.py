"""The live predictor as a routing policy, so that a virtual-time replay measures it.

:class:`PredictorPolicy` wraps the real :class:`~foretoken.core.routing.service.Predictor` (the
code the
route service runs) and feeds it exactly what the live pipeline would, in the order it
would, on one clock (the replay's virtual seconds):

* **registrations** built from what each engine reports about itself
  (:func:`registration_from_info` / :func:`registration_from_spec`: model, engine and
  version, block size, scheduler settings, KV hash algorithm, tiers, EAGLE, GPU blocks,
  config hash) — never a simulated engine's hidden ``truth``; the index registers each
  worker as the index keeper does;
* **KV events** wrapped in :class:`~foretoken.wire.records.KvEventBatch` (one per delivery,
  ``seq`` counting per worker), as ingest writes them and the index agent applies them;
* **grants**: its own decisions (:meth:`Predictor.route` then :meth:`Predictor.on_grant`,
  which is idempotent, as when the grant comes back on ``grants``) and the grading join;
* **outcomes** shaped as the router publishes them: a ``first_token`` outcome with the
  TTFT, then a ``completion`` with the engine-reported cached tokens, output tokens,
  end-to-end time and error;
* **graded** records from the real grading join (:class:`~foretoken.core.grading.join.GradingJoin`,
  i.e. :func:`~foretoken.core.grading.join.grade` of grant + outcomes), so the fits learn from the
  cold
  samples the live predictor would learn from.

The live pipeline delivers graded records a little later than the completion; here they
are delivered at once (the replay has no broker lag). Join and queue expiry run every
``maintain_every_s`` virtual seconds, as the worker's timer does.

The decision carries the prediction (predicted TTFT, queue wait, own prefill, credited
cached tokens and tier, queued tokens ahead, fit, candidates, explore), so the replay's
records grade it. Registered as ``"predictor"``.

:class:`ApproxPredictorPolicy` (``"predictor-approx"``) is the same predictor for engines
that publish no KV events and report no cached tokens (issue 9): every worker registers
with ``has_kv_events = reports_cached_tokens = False``, the replay builds no KV events, the
index credits routed prompts only (:mod:`foretoken.core.index.approx`), and the engines' cached
tokens
are withheld from the predictor. The replay's own records still carry what the simulated
engine reused, so its cache disagreement measures how far the approximate credit is off.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Self

import msgspec
import numpy as np

from foretoken.core.grading.join import DEFAULT_TIMEOUT_S, GradingJoin
from foretoken.core.index.approx import ApproxCacheConfig, index_params
from foretoken.core.index.prefix import PrefixIndex
from foretoken.core.routing.controls import LatencyControls
from foretoken.core.routing.service import Predictor, PredictorConfig
from foretoken.core.types import ModelName, RequestId, WorkerId
from foretoken.sim.policy import (
    Decision,
    FleetView,
    RouteRequest,
    WorkerInfo,
    register_policy,
)
from foretoken.sim.prefix_cache import KvEventDetail, TokenIds
from foretoken.sim.spec import EngineSpec, FleetSpec
from foretoken.wire.records import (
    CandidatePrediction,
    Graded,
    Grant,
    KvEvent,
    KvEventBatch,
    Outcome,
    WorkerEndpoints,
    WorkerRegistration,
)
from foretoken.wire.records import RouteRequest as WireRouteRequest

POLICY_NAME = "predictor"
APPROX_POLICY_NAME = "predictor-approx"
REASON_ADMITTED = "lowest_predicted_ttft"
REASON_EXPLORE = "explore"
# Simulated engines have no URL; the registration still names one (the router needs it).
SIM_URL_SCHEME = "sim"
# How often the join and the queues expire what waited too long (the worker's timer).
DEFAULT_MAINTAIN_EVERY_S = 5.0


def _endpoints(worker_id: str) -> WorkerEndpoints:
    return WorkerEndpoints(http_url=f"{SIM_URL_SCHEME}://{worker_id}")


def registration_from_info(info: WorkerInfo, *, ts: float = 0.0) -> WorkerRegistration:
    """The ``workers`` record of a worker as the fleet view describes it (reported
    settings only). ``gpu_blocks`` is taken when the view carries it."""
    gpu_blocks = getattr(info, "gpu_blocks", None)  # WorkerInfo may gain it; never truth
    return WorkerRegistration(
        worker_id=info.worker_id,
        model=info.model,
        engine=info.engine,
        engine_version=info.engine_version,
        block_size=info.block_size,
        scheduler=info.scheduler,
        kv_hash_algo=info.kv_hash_algo,
        tiers=info.tiers,
        endpoints=_endpoints(info.worker_id),
        eagle=info.eagle,
        gpu_blocks=gpu_blocks if isinstance(gpu_blocks, int) else None,
        config_hash=info.config_hash,
        ts=ts,
    )


def registration_from_spec(spec: EngineSpec, *, ts: float = 0.0) -> WorkerRegistration:
    """The ``workers`` record a simulated engine publishes: its reported fields (GPU
    blocks included, as vLLM's cache_config_info tells), never ``spec.truth``."""
    return WorkerRegistration(
        worker_id=spec.id,
        model=spec.model,
        engine=spec.engine,
        engine_version=spec.engine_version,
        block_size=spec.block_size,
        scheduler=spec.scheduler,
        kv_hash_algo=spec.kv_hash_algo,
        tiers=spec.tiers,
        endpoints=_endpoints(spec.id),
        eagle=spec.eagle,
        gpu_blocks=spec.kv.gpu_blocks,
        config_hash=spec.config_hash,
        ts=ts,
    )


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
    """A :class:`~foretoken.sim.policy.RoutingPolicy` backed by the live :class:`Predictor`."""

    name = POLICY_NAME
    kv_events: KvEventDetail = "full"

    def __init__(
        self,
        fleet: FleetView,
        seed: int = 0,
        *,
        registrations: Sequence[WorkerRegistration] | None = None,
        config: PredictorConfig | None = None,
        join_timeout_s: float = DEFAULT_TIMEOUT_S,
        maintain_every_s: float = DEFAULT_MAINTAIN_EVERY_S,
        approx: ApproxCacheConfig | None = None,
        controls: LatencyControls | None = None,
    ) -> None:
        base = replace(config or PredictorConfig(), seed=seed)  # the policy's seed wins
        self.approx = approx or ApproxCacheConfig()
        self.index = PrefixIndex()
        self.predictor = Predictor(self.index, config=base, controls=controls)
        self.join = GradingJoin(block_size_of=self._block_size_of, timeout_s=join_timeout_s)
        self.counters = PolicyCounters()
        self._maintain_every_s = maintain_every_s
        self._next_maintain_s = maintain_every_s
        self._registrations: dict[WorkerId, WorkerRegistration] = {}
        self._models: dict[WorkerId, ModelName] = {}
        self._kv_seq: dict[WorkerId, int] = {}
        self._ttft: dict[RequestId, float] = {}
        self._cached: dict[RequestId, int | None] = {}
        regs = registrations
        if regs is None:
            regs = [registration_from_info(info) for info in fleet.workers]
        for registration in regs:
            self.register(registration)

    @classmethod
    def for_fleet(
        cls,
        fleet: FleetSpec,
        seed: int = 0,
        *,
        config: PredictorConfig | None = None,
        controls: LatencyControls | None = None,
    ) -> Self:
        """A policy for a simulated fleet, registered from each engine's reported fields
        (with GPU blocks, which the generic :class:`FleetView` does not carry); with
        ``controls``, the latency controls run in the replay's virtual time."""
        view = FleetView([WorkerInfo.from_spec(spec) for spec in fleet.engines])
        regs = [registration_from_spec(spec) for spec in fleet.engines]
        return cls(view, seed, registrations=regs, config=config, controls=controls)

    # ------------------------------------------------------------------ observations

    def register(self, registration: WorkerRegistration) -> None:
        """A ``workers`` record: to the index (as the index keeper) and the predictor."""
        wid = registration.worker_id
        if registration.removed:
            self.index.remove_worker(wid)
            self._registrations.pop(wid, None)
            self._models.pop(wid, None)
        else:
            ttl_s, capacity = index_params(registration, self.approx)
            self.index.register_worker(
                wid, registration.model, registration.block_size, eagle=registration.eagle,
                store_only_ttl_s=ttl_s, capacity_blocks=capacity,
            )  # fmt: skip
            self._registrations[wid] = registration
            self._models[wid] = registration.model
        self.predictor.on_registration(registration)

    def _block_size_of(self, worker_id: WorkerId) -> int | None:
        registration = self._registrations.get(worker_id)
        return registration.block_size if registration is not None else None

    def on_kv_events(self, worker_id: WorkerId, events: Sequence[KvEvent], t_s: float) -> None:
        model = self._models.get(worker_id)
        if model is None or not events:
            return
        seq = self._kv_seq.get(worker_id, 0)
        self._kv_seq[worker_id] = seq + 1
        batch = KvEventBatch(
            worker_id=worker_id, model=model, seq=seq, ts=t_s, events=tuple(events)
        )
        self.index.apply(batch, t_s)
        self.counters.kv_batches += 1
        self._maintain(t_s)

    def on_first_token(
        self,
        request_id: RequestId,
        worker_id: WorkerId,
        ttft_s: float,
        engine_cached_tokens: int | None,
        t_s: float,
    ) -> None:
        # The router's first-token outcome carries the TTFT; the cached tokens come with
        # the completion (the engine's usage block).
        self._ttft[request_id] = ttft_s
        self._cached[request_id] = engine_cached_tokens
        outcome = Outcome(
            request_id=request_id,
            ts=t_s,
            kind="first_token",
            worker_id=worker_id,
            actual_ttft_s=ttft_s,
        )
        self._outcome(outcome, t_s)

    def on_finished(
        self,
        request_id: RequestId,
        worker_id: WorkerId,
        output_tokens: int,
        e2e_s: float,
        t_s: float,
        error: str | None = None,
    ) -> None:
        ttft_s = self._ttft.pop(request_id, None)
        cached = self._cached.pop(request_id, None)
        outcome = Outcome(
            request_id=request_id,
            ts=t_s,
            kind="completion",
            worker_id=worker_id,
            status="ok" if error is None else "error",
            actual_ttft_s=ttft_s,
            engine_cached_tokens=cached,
            output_tokens=output_tokens,
            e2e_s=e2e_s,
            error=error,
        )
        self._outcome(outcome, t_s)

    def _outcome(self, outcome: Outcome, t_s: float) -> None:
        self.counters.outcomes += 1
        self.predictor.on_outcome(outcome, t_s)
        self._graded(self.join.on_outcome(outcome, t_s), t_s)
        self._maintain(t_s)

    def _graded(self, records: list[Graded], t_s: float) -> None:
        for graded in records:
            self.counters.graded += 1
            if self.predictor.on_graded(graded, t_s):
                self.counters.cold_samples += 1

    def _maintain(self, t_s: float) -> None:
        controls = self.predictor.controls
        if controls is not None:  # the worker's controls timer (self-throttled)
            controls.tick(t_s)
        if t_s < self._next_maintain_s:
            return
        self._next_maintain_s = t_s + self._maintain_every_s
        self.predictor.maintain(t_s)
        self._graded(self.join.expire(t_s), t_s)

    # ------------------------------------------------------------------ decisions

    def decide(self, request: RouteRequest, fleet: FleetView) -> Decision:
        now_s = request.arrival_s
        self._maintain(now_s)
        wire = WireRouteRequest(
            request_id=request.request_id,
            model=request.model,
            token_ids=_token_tuple(request.token_ids),
            prompt_tokens=max(request.prompt_tokens, 1),
            max_queue_wait_s=request.max_queue_wait_s,
            already_waited_s=request.already_waited_s,
            workload_class=request.workload_class,
            conversation_id=request.conversation_id,
            expected_output_tokens=request.max_tokens,
        )
        grant = self.predictor.route(wire, now_s, now_s).grant
        self.counters.decisions += 1
        self.counters.rerouted += grant.rerouted_from is not None
        self.on_grant(grant, now_s)
        return decision_from_grant(grant)

    def on_grant(self, grant: Grant, t_s: float) -> None:
        """A grant as it arrives on ``grants``: its own (a no-op for the queues, which took
        it at decision time) or another router's or replica's, as a read replica
        follows the decisions it did not make. Into the queue model and the join."""
        self.predictor.on_grant(grant, t_s)
        self._graded(self.join.on_grant(grant, t_s), t_s)

    def predict_on(self, request: RouteRequest, worker_id: WorkerId) -> CandidatePrediction | None:
        """This predictor's prediction for ``request`` on one worker, without deciding
        (None when that worker is not a candidate)."""
        tokens = _token_tuple(request.token_ids)
        for candidate in self.predictor.predict(
            request.model, tokens, request.arrival_s, request.prompt_tokens
        ):
            if candidate.prediction.worker_id == worker_id:
                return candidate.prediction
        return None


def _finite_or_none(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


def decision_from_grant(grant: Grant) -> Decision:
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

    def register(self, registration: WorkerRegistration) -> None:
        if not registration.removed:
            registration = msgspec.structs.replace(
                registration, has_kv_events=False, reports_cached_tokens=False
            )
        super().register(registration)

    def on_first_token(
        self,
        request_id: RequestId,
        worker_id: WorkerId,
        ttft_s: float,
        engine_cached_tokens: int | None,
        t_s: float,
    ) -> None:
        super().on_first_token(request_id, worker_id, ttft_s, None, t_s)  # the engine says nothing


register_policy(POLICY_NAME, PredictorPolicy)
register_policy(APPROX_POLICY_NAME, ApproxPredictorPolicy)
