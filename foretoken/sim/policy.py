"""Routing policies: the seam through which a predictor routes and admits requests.

A :class:`RoutingPolicy` is asked once per request, at its arrival, with a
:class:`Arrival` and a read-only :class:`FleetView`, and answers with a
:class:`Decision`: a worker of the request's model, or ``None`` to reject (with a reason
and an optional Retry-After), plus whatever prediction it made (predicted TTFT and its
parts, the cached tokens it credited, per-candidate predictions, an explore flag). A
decision converts into the ``grants`` record of PRODUCT.md §2 with :meth:`Decision.grant`.

**What a policy may know** is exactly what the router side of the real pipeline knows:

* per worker, what the engine *reports* about itself (:class:`WorkerProfile`: model, block
  size, scheduler settings, tiers, KV hash algorithm, config hash) — never the hidden
  true cost of a simulated engine;
* per worker, what the router has sent there and not yet seen finish
  (:class:`WorkerLoad`), kept by the driver in a :class:`FleetLedger`;
* through the feedback callbacks, the events the real pipeline would see, at the time it
  would see them: KV events (``on_kv_events``), first tokens with the engine-reported
  cached tokens (``on_first_token``, a :class:`FirstTokenSeen`) and completions
  (``on_finished``, a :class:`FinishedSeen`). Nothing else.

A driver (the virtual-time replay in :mod:`foretoken.sim.replay`, later the live route service)
updates the ledger *before* it calls a callback, so a policy that reads the view inside a
callback sees the state after the event.

Policies are pluggable (house rule 5): :func:`register_policy` adds a factory under a
name, :func:`make_policy` builds one for a fleet view and a seed, and
``tests/unit/test_policy.py`` runs one contract suite against every registered policy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from foretoken.core.routing.fallback import Load, least_outstanding
from foretoken.core.types import (
    CandidatePrediction,
    ConversationId,
    FitUsed,
    KvEvent,
    ModelName,
    RequestId,
    RouteDecision,
    Tier,
    WorkerId,
    WorkerProfile,
)
from foretoken.sim.prefix_cache import KvEventDetail, TokenIds
from foretoken.sim.spec import FleetSpec

DEFAULT_WORKLOAD_CLASS = "default"
REASON_ROUND_ROBIN = "round_robin"
REASON_LEAST_OUTSTANDING = "least_outstanding_tokens"
REASON_NO_WORKER = "no_worker_for_model"


# ---------------------------------------------------------------------------- inputs


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request as the router sees it before sending it anywhere.

    ``token_ids`` may be None when the caller only knows the prompt's length; a policy
    that needs the content must then treat the prompt as uncached."""

    request_id: RequestId
    model: ModelName
    arrival_s: float
    prompt_tokens: int
    token_ids: TokenIds | None = None
    max_tokens: int | None = None
    max_queue_wait_s: float | None = None
    already_waited_s: float = 0.0
    conversation_id: ConversationId | None = None
    workload_class: str = DEFAULT_WORKLOAD_CLASS


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What the router has sent to one worker and not yet seen finish."""

    outstanding_requests: int = 0
    outstanding_prompt_tokens: int = 0
    # Of those, the ones without a first token yet (still queued or prefilling).
    awaiting_first_token: int = 0
    awaiting_prompt_tokens: int = 0


@dataclass(slots=True)
class _MutableLoad:
    requests: int = 0
    prompt_tokens: int = 0
    awaiting: int = 0
    awaiting_tokens: int = 0


class FleetView:
    """A read-only view of the fleet for policies: reported settings and router-side load."""

    def __init__(self, workers: Sequence[WorkerProfile]) -> None:
        self._workers = {info.worker_id: info for info in workers}
        if len(self._workers) != len(workers):
            raise ValueError("worker ids must be unique")
        self._by_model: dict[ModelName, tuple[WorkerProfile, ...]] = {}
        for info in workers:
            self._by_model[info.model] = (*self._by_model.get(info.model, ()), info)
        self._load = {worker_id: _MutableLoad() for worker_id in self._workers}

    @property
    def workers(self) -> tuple[WorkerProfile, ...]:
        return tuple(self._workers.values())

    def worker(self, worker_id: WorkerId) -> WorkerProfile:
        return self._workers[worker_id]

    def models(self) -> tuple[ModelName, ...]:
        return tuple(self._by_model)

    def workers_for(self, model: str) -> tuple[WorkerProfile, ...]:
        """The workers serving ``model``, in registration order (empty when none)."""
        return self._by_model.get(ModelName(model), ())

    def load(self, worker_id: WorkerId) -> WorkerLoad:
        state = self._load[worker_id]
        return WorkerLoad(
            state.requests, state.prompt_tokens, state.awaiting, state.awaiting_tokens
        )


class FleetLedger(FleetView):
    """The driver's side of a :class:`FleetView`: it records what was sent and what came
    back. Policies receive it typed as a ``FleetView`` and never call these methods."""

    def __init__(self, workers: Sequence[WorkerProfile]) -> None:
        super().__init__(workers)
        self._sent: dict[RequestId, tuple[WorkerId, int, bool]] = {}

    @classmethod
    def for_fleet(cls, fleet: FleetSpec) -> FleetLedger:
        return cls([spec.profile() for spec in fleet.engines])

    def record_sent(self, request_id: RequestId, worker_id: WorkerId, prompt_tokens: int) -> None:
        state = self._load[worker_id]
        state.requests += 1
        state.prompt_tokens += prompt_tokens
        state.awaiting += 1
        state.awaiting_tokens += prompt_tokens
        self._sent[request_id] = (worker_id, prompt_tokens, True)

    def record_first_token(self, request_id: RequestId) -> None:
        worker_id, prompt_tokens, awaiting = self._sent[request_id]
        if awaiting:
            state = self._load[worker_id]
            state.awaiting -= 1
            state.awaiting_tokens -= prompt_tokens
            self._sent[request_id] = (worker_id, prompt_tokens, False)

    def record_finished(self, request_id: RequestId) -> None:
        self.record_first_token(request_id)
        worker_id, prompt_tokens, _ = self._sent.pop(request_id)
        state = self._load[worker_id]
        state.requests -= 1
        state.prompt_tokens -= prompt_tokens


# ---------------------------------------------------------------------------- feedback


@dataclass(frozen=True, slots=True)
class FirstTokenSeen:
    """A request's first token arrived at ``t_s``, ``ttft_s`` after its arrival, with the
    cached tokens the engine reported (None: it reports none)."""

    request_id: RequestId
    worker_id: WorkerId
    ttft_s: float
    engine_cached_tokens: int | None
    t_s: float


@dataclass(frozen=True, slots=True)
class FinishedSeen:
    """A request completed at ``t_s`` (``error`` set when the worker failed it)."""

    request_id: RequestId
    worker_id: WorkerId
    output_tokens: int
    e2e_s: float
    t_s: float
    error: str | None = None
    decode_step_s: float | None = None  # a decode step from its token gaps


# ---------------------------------------------------------------------------- decisions


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's answer: ``worker_id`` None = rejected (429 with ``retry_after_s``).

    Prediction fields are None when the policy made no prediction; ``cached_tokens`` is
    what the policy credited as cached on the chosen worker (None = it did not look)."""

    worker_id: WorkerId | None
    reason: str
    retry_after_s: float | None = None
    predicted_ttft_s: float | None = None
    predicted_ttft_p90_s: float | None = None
    queue_wait_s: float | None = None
    prefill_s: float | None = None
    cached_tokens: int | None = None
    cached_tier: Tier | None = None
    queue_tokens_ahead: int = 0
    fit: FitUsed | None = None
    explore: bool = False
    candidates: tuple[CandidatePrediction, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.reason:
            raise ValueError("a decision states its reason")
        names = ("retry_after_s", "predicted_ttft_s", "predicted_ttft_p90_s", "queue_wait_s",
                 "prefill_s")  # fmt: skip
        for name in names:
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if self.cached_tokens is not None and self.cached_tokens < 0:
            raise ValueError("cached_tokens must be >= 0")

    @property
    def admitted(self) -> bool:
        return self.worker_id is not None

    @classmethod
    def reject(cls, reason: str, retry_after_s: float | None = None) -> Decision:
        return cls(worker_id=None, reason=reason, retry_after_s=retry_after_s)

    def grant(self, request: Arrival, ts: float) -> RouteDecision:
        """The ``grants`` value of this decision."""
        return RouteDecision(
            request_id=request.request_id,
            ts=ts,
            model=request.model,
            workload_class=request.workload_class,
            prompt_tokens=request.prompt_tokens,
            worker_id=self.worker_id,
            admitted=self.admitted,
            reject_reason=None if self.admitted else self.reason,
            retry_after_s=self.retry_after_s,
            predicted_ttft_s=self.predicted_ttft_s,
            queue_wait_s=self.queue_wait_s,
            prefill_s=self.prefill_s,
            cached_tokens=self.cached_tokens or 0,
            cached_tier=self.cached_tier,
            queue_tokens_ahead=self.queue_tokens_ahead,
            fit=self.fit,
            max_queue_wait_s=request.max_queue_wait_s,
            already_waited_s=request.already_waited_s,
            explore=self.explore,
            conversation_id=request.conversation_id,
            expected_output_tokens=request.max_tokens,
            candidates=self.candidates,
        )


# ---------------------------------------------------------------------------- protocol


@runtime_checkable
class RoutingPolicy(Protocol):
    """Routes and admits requests; learns only from the callbacks' events.

    ``kv_events`` says how much of the KV events the policy needs: ``"full"`` (with token
    ids, as the real pipeline's index consumes them), ``"hashes"`` or ``"off"`` (then
    ``on_kv_events`` is not called and a simulator may skip building them)."""

    name: str
    kv_events: KvEventDetail

    def decide(self, request: Arrival, fleet: FleetView) -> Decision:
        """Choose a worker of ``request.model`` or reject; must not raise for a request
        it cannot place (reject it with a reason instead)."""
        ...

    def on_kv_events(self, worker_id: WorkerId, events: Sequence[KvEvent], t_s: float) -> None:
        """KV events a worker published at ``t_s``, in order."""
        ...

    def on_first_token(self, seen: FirstTokenSeen) -> None:
        """A request's first token arrived."""
        ...

    def on_finished(self, seen: FinishedSeen) -> None:
        """A request completed (or failed)."""
        ...


class IgnoresFeedback:
    """Callbacks that do nothing, for policies that do not learn."""

    kv_events: KvEventDetail = "off"

    def on_kv_events(self, worker_id: WorkerId, events: Sequence[KvEvent], t_s: float) -> None:
        return None

    def on_first_token(self, seen: FirstTokenSeen) -> None:
        return None

    def on_finished(self, seen: FinishedSeen) -> None:
        return None


# ---------------------------------------------------------------------------- baselines


class RoundRobin(IgnoresFeedback):
    """Each model's workers in turn; never rejects a request its model can serve."""

    name = "round-robin"

    def __init__(self, fleet: FleetView, seed: int = 0) -> None:
        # Each model's rotation starts at the worker the seed points to.
        self._seed = seed
        self._next: dict[ModelName, int] = {}

    def decide(self, request: Arrival, fleet: FleetView) -> Decision:
        workers = fleet.workers_for(request.model)
        if not workers:
            return Decision.reject(REASON_NO_WORKER)
        position = self._next.get(request.model, self._seed)
        self._next[request.model] = position + 1
        return Decision(workers[position % len(workers)].worker_id, REASON_ROUND_ROBIN)


class LeastOutstandingTokens(IgnoresFeedback):
    """The router's fallback policy (:func:`foretoken.core.routing.fallback.least_outstanding`):
    the worker of the model with the fewest prompt tokens sent and not finished (ties: fewer
    outstanding requests, then registration order); never rejects."""

    name = "least-outstanding-tokens"

    def __init__(self, fleet: FleetView, seed: int = 0) -> None:
        pass  # deterministic: nothing to seed

    def decide(self, request: Arrival, fleet: FleetView) -> Decision:
        workers = fleet.workers_for(request.model)
        if not workers:
            return Decision.reject(REASON_NO_WORKER)
        best = least_outstanding(workers, lambda info: _load(fleet.load(info.worker_id)))
        assert best is not None  # no overload limit: some worker of the model is chosen
        return Decision(best.worker_id, REASON_LEAST_OUTSTANDING)


def _load(load: WorkerLoad) -> Load:
    return Load(load.outstanding_prompt_tokens, load.outstanding_requests)


# ---------------------------------------------------------------------------- registry

PolicyFactory = Callable[[FleetView, int], RoutingPolicy]
_REGISTRY: dict[str, PolicyFactory] = {}


def register_policy(name: str, factory: PolicyFactory, *, replace: bool = False) -> None:
    """Make a policy available to :func:`make_policy` (and the CLI) under ``name``."""
    if name in _REGISTRY and not replace:
        raise ValueError(f"a policy named {name!r} is already registered")
    _REGISTRY[name] = factory


def unregister_policy(name: str) -> None:
    _REGISTRY.pop(name, None)


def policy_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def make_policy(name: str, fleet: FleetView, *, seed: int = 0) -> RoutingPolicy:
    """A fresh policy for ``fleet``; same name and seed give the same decisions."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(policy_names())}") from None
    return factory(fleet, seed)


register_policy(RoundRobin.name, RoundRobin)
register_policy(LeastOutstandingTokens.name, LeastOutstandingTokens)
