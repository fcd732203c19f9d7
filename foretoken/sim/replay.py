"""Virtual-time replay of a trace through simulated engines (PRODUCT.md §3 "Fleet simulator").

:func:`replay` is a discrete-event loop over virtual seconds. It drives one
:class:`~foretoken.sim.engine.EngineModel` per engine of the fleet from a heap of the next
events — the trace's arrivals and each engine's step ends — and at each arrival asks the
:class:`~foretoken.sim.policy.RoutingPolicy` where the request goes (routing costs no virtual
time), then submits it to that engine. Everything an engine produces in a step (KV events,
first tokens, completions) is delivered at the step's *end*, to the router-side ledger
first and then to the policy's callbacks, in that order: KV events, first tokens,
completions. Events at the same instant run as: step ends, then arrivals, then the engines
that became free start their next step — so a request arriving exactly when a step ends
is in the next step. Runs of pure-decode steps are computed in one go by
:meth:`~foretoken.sim.engine.EngineModel.decode_run` (exactly equivalent to stepping; each step's
KV events are still delivered at that step's end). The engines build KV events in the
detail the policy asks for (``policy.kv_events``; none for the baselines).

Every request yields one :class:`~foretoken.wire.records.Graded` record, in arrival order:
``served`` (first token and completion seen), ``rejected`` (the policy said no) or
``error`` (the chosen engine could never hold it: :class:`~foretoken.sim.engine.RequestTooLarge`).
``ts`` is the arrival as a Unix timestamp: ``EPOCH_BASE_TS`` + virtual seconds.

**Schedule**: a fleet's ``[[schedule]]`` changes (:class:`~foretoken.sim.spec.ScheduleChange`)
apply before the first event at or after their ``at_s``: the engine's true costs change
from its next step on and, when the version changes, the policy's ``register`` (if it has
one) gets the engine's new profile, as the processor gets a re-registration.

**Lake** (:func:`write_lake`): the records go through the one lake writer,
:class:`foretoken.adapters.lake.writer.LakeWriter` (layout, write-then-rename and idempotency are
described
there): one Parquet file per UTC hour of ``ts`` per call under
``OUT_DIR/graded/hour=YYYY-MM-DDTHH/``, columns = the ``Graded`` fields; repeated calls add
files, never rewrite them.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from foretoken.adapters.lake.writer import (  # noqa: F401  (re-exported: the lake's writer is foretoken.adapters.lake.writer)
    HOUR_FORMAT,
    HOUR_PARTITION,
    LAKE_TABLE,
    US_PER_S,
    graded_frame,
    graded_schema,
    write_lake,
)
from foretoken.core.types import CacheSource, ModelName, RequestId, WorkerId
from foretoken.sim.engine import (
    DecodeRun,
    EngineModel,
    Finished,
    FirstToken,
    RequestTooLarge,
    StepResult,
)
from foretoken.sim.policy import (
    Arrival,
    Decision,
    FinishedSeen,
    FirstTokenSeen,
    FleetLedger,
    RoutingPolicy,
    make_policy,
)
from foretoken.sim.spec import FleetSpec, ScheduleChange, load_fleet
from foretoken.sim.traces import (
    AZURE_CODE_FILE,
    AZURE_CONV_FILE,
    TraceRequest,
    default_trace_path,
    load_azure,
    load_mooncake,
)
from foretoken.wire.records import Graded, KvEvent

EPOCH_BASE_TS = datetime(2025, 1, 1, tzinfo=UTC).timestamp()
PERCENTILES = (50.0, 95.0, 99.0)
PROGRESS_EVERY = 64
# Heap entry kinds: a step's end, KV events inside a decode run, a decode run's end.
_STEP, _DELIVERY, _RUN = 0, 1, 2
Status = Literal["served", "rejected", "error"]


@dataclass(slots=True)
class _Flight:
    """An admitted request between its submission and its completion."""

    index: int
    request: TraceRequest
    arrival_s: float
    decision: Decision
    # The chosen worker's block size (0 when rejected).
    block_size: int
    first_token: FirstToken | None = None


@dataclass(frozen=True, slots=True)
class QueuePrediction:
    """The records of a replay (one per request, in arrival order) and its run stats."""

    records: tuple[Graded, ...]
    fleet: str
    policy: str
    speedup: float
    wall_s: float
    virtual_s: float
    engine_steps: int

    def summary(self) -> dict[str, Any]:
        return {
            "fleet": self.fleet,
            "policy": self.policy,
            "speedup": self.speedup,
            **summary(self.records),
            "wall_s": self.wall_s,
            "virtual_s": self.virtual_s,
            "engine_steps": self.engine_steps,
        }


# ---------------------------------------------------------------------------- records


def _graded(flight: _Flight, status: Status, model: ModelName, **outcome: Any) -> Graded:
    """The record of one request; ``outcome`` holds what only a served one has."""
    decision, request = flight.decision, flight.request
    fit = decision.fit
    # The chosen candidate says where its cache credit came from (predictor policies).
    chosen = next((c for c in decision.candidates if c.worker_id == decision.worker_id), None)
    return Graded(
        request_id=request.request_id,
        ts=EPOCH_BASE_TS + flight.arrival_s,
        model=model,
        workload_class=request.workload_class,
        worker_id=decision.worker_id,
        status=status,
        admitted=decision.admitted,
        explore=decision.explore,
        prompt_tokens=request.prompt_tokens,
        predicted_ttft_s=decision.predicted_ttft_s,
        predicted_ttft_p90_s=decision.predicted_ttft_p90_s,
        queue_wait_s=decision.queue_wait_s,
        prefill_s=decision.prefill_s,
        credited_cached_tokens=decision.cached_tokens or 0,
        block_size=flight.block_size if decision.admitted else None,
        max_queue_wait_s=request.max_queue_wait_s,
        retry_after_s=decision.retry_after_s,
        fit_a=fit.a if fit else None,
        fit_b=fit.b if fit else None,
        fit_samples=fit.samples if fit else None,
        fit_default=fit.default if fit else None,
        queue_tokens_ahead=decision.queue_tokens_ahead,
        approximate_cache=chosen.approximate_cache if chosen is not None else False,
        cache_source=chosen.cache_source if chosen is not None else CacheSource.EVENTS,
        **outcome,
    )


def _served_outcome(flight: _Flight, finished: Finished) -> dict[str, Any]:
    first = flight.first_token
    if first is None:
        raise RuntimeError(f"{finished.request_id} finished without a first token")
    predicted, credited = flight.decision.predicted_ttft_s, flight.decision.cached_tokens
    return {
        "actual_ttft_s": first.ttft_s,
        "error_s": None if predicted is None else predicted - first.ttft_s,
        "engine_cached_tokens": first.cached_tokens,
        "cache_disagreement": (
            None if credited is None else abs(credited - first.cached_tokens) >= flight.block_size
        ),
        "output_tokens": finished.output_tokens,
        "e2e_s": finished.time_s - finished.arrival_s,
    }


# ---------------------------------------------------------------------------- the loop


@dataclass(slots=True)
class _Replay:
    trace: Sequence[TraceRequest]
    fleet: FleetSpec
    policy: RoutingPolicy
    model: ModelName
    speedup: float
    decode_runs: bool = True
    engine_factory: Callable[..., EngineModel] = EngineModel
    engines: dict[WorkerId, EngineModel] = field(default_factory=dict)
    changes: list[ScheduleChange] = field(default_factory=list)
    ledger: FleetLedger = field(init=False)
    heap: list[tuple[float, int, int, WorkerId, Any]] = field(default_factory=list)
    busy: set[WorkerId] = field(default_factory=set)
    ready: dict[WorkerId, None] = field(default_factory=dict)
    flights: dict[RequestId, _Flight] = field(default_factory=dict)
    records: list[Graded | None] = field(default_factory=list)
    seq: int = 0
    steps: int = 0
    now_s: float = 0.0

    def __post_init__(self) -> None:
        detail = self.policy.kv_events
        make = self.engine_factory
        self.engines = {spec.id: make(spec, kv_events=detail) for spec in self.fleet.engines}
        self.changes = list(reversed(self.fleet.schedule))  # popped from the end
        self.ledger = FleetLedger.for_fleet(self.fleet)
        self.records = [None] * len(self.trace)

    def run(self, progress: Progress) -> None:
        task = progress.add_task(f"replay {self.fleet.name}", total=len(self.trace))
        trace, heap = self.trace, self.heap
        n, index = len(trace), 0
        next_arrival = trace[0].arrival_s / self.speedup if n else math.inf
        while index < n or heap:
            if self.changes:
                self._apply_due(min(heap[0][0] if heap else math.inf, next_arrival))
            if heap and heap[0][0] <= next_arrival:
                self.now_s = heap[0][0]
                self._pop()
            else:
                self.now_s = next_arrival
                self._arrive(index, trace[index], next_arrival)
                index += 1
                next_arrival = trace[index].arrival_s / self.speedup if index < n else math.inf
                if index % PROGRESS_EVERY == 0:
                    progress.update(task, completed=index)
            if self.ready and (not heap or heap[0][0] > self.now_s) and next_arrival > self.now_s:
                self._start_ready(next_arrival)
        progress.update(task, completed=n)

    def _apply_due(self, until_s: float) -> None:
        """The schedule's changes due by ``until_s`` (module doc)."""
        while self.changes and self.changes[-1].at_s <= until_s:
            change = self.changes.pop()
            engine = self.engines[change.engine]
            before = engine.spec
            engine.retune(change.apply(before))
            register = getattr(self.policy, "register", None)
            if engine.spec.engine_version != before.engine_version and register is not None:
                register(engine.spec.profile(ts=max(change.at_s, self.now_s)))

    # -------------------------------------------------------------- arrivals

    def _arrive(self, index: int, request: TraceRequest, arrival_s: float) -> None:
        token_ids = request.token_ids
        route = Arrival(
            request_id=request.request_id,
            model=self.model,
            arrival_s=arrival_s,
            prompt_tokens=request.prompt_tokens,
            token_ids=token_ids,
            max_tokens=request.sent_max_tokens,
            max_queue_wait_s=request.max_queue_wait_s,
            conversation_id=request.conversation_id,
            workload_class=request.workload_class,
        )
        decision = self.policy.decide(route, self.ledger)
        worker_id = decision.worker_id
        block_size = 0
        if worker_id is not None:
            block_size = self._check_choice(worker_id, decision)
        flight = _Flight(index, request, arrival_s, decision, block_size)
        if worker_id is None:
            self._record(flight, "rejected")
            return
        try:
            self.engines[worker_id].submit(
                request.request_id, token_ids, request.output_tokens, arrival_s
            )
        except RequestTooLarge as exc:
            self._record(flight, "error")
            self.policy.on_finished(
                FinishedSeen(request.request_id, worker_id, 0, 0.0, arrival_s, str(exc))
            )
            return
        self.ledger.record_sent(request.request_id, worker_id, request.prompt_tokens)
        self.flights[request.request_id] = flight
        if worker_id not in self.busy:
            self.ready[worker_id] = None

    def _check_choice(self, worker_id: WorkerId, decision: Decision) -> int:
        engine = self.engines.get(worker_id)
        if engine is None or engine.spec.model != self.model:
            raise ValueError(
                f"policy {self.policy.name!r} chose {worker_id!r}, not a worker of "
                f"{self.model!r} (reason {decision.reason!r})"
            )
        return engine.spec.block_size

    def _record(self, flight: _Flight, status: Status, **outcome: Any) -> None:
        self.records[flight.index] = _graded(flight, status, self.model, **outcome)

    # -------------------------------------------------------------- engines

    def _start_ready(self, until_s: float) -> None:
        now = self.now_s
        for worker_id in self.ready:
            engine = self.engines[worker_id]
            if engine.next_event_time is None:
                continue
            run = engine.decode_run(now, until_s) if self.decode_runs else None
            if run is not None:
                self._push_run(worker_id, run)
                continue
            result = engine.step(now)
            self.steps += 1
            if result.chunks:
                self._push(result.end_s, _STEP, worker_id, result)
                self.busy.add(worker_id)
            elif result.kv_events:
                self._deliver_kv(worker_id, result.kv_events, now)
        self.ready.clear()

    def _push(self, at_s: float, kind: int, worker_id: WorkerId, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at_s, self.seq, kind, worker_id, payload))

    def _push_run(self, worker_id: WorkerId, run: DecodeRun) -> None:
        self.steps += run.num_steps
        for step_index, events in run.kv_events:
            self._push(run.step_ends_s[step_index], _DELIVERY, worker_id, events)
        self._push(run.end_s, _RUN, worker_id, run)
        self.busy.add(worker_id)

    def _pop(self) -> None:
        at_s, _, kind, worker_id, payload = heapq.heappop(self.heap)
        if kind == _DELIVERY:
            self._deliver_kv(worker_id, payload, at_s)
            return
        if kind == _STEP:
            result: StepResult = payload
            self._deliver_kv(worker_id, result.kv_events, at_s)
            for first in result.first_tokens:
                self._first_token(worker_id, first, at_s)
            finished: Iterable[Finished] = result.finished
        else:
            finished = payload.finished
        for done in finished:
            self._finished(worker_id, done, at_s)
        self.busy.discard(worker_id)
        self.ready[worker_id] = None

    def _deliver_kv(self, worker_id: WorkerId, events: Sequence[KvEvent], at_s: float) -> None:
        if events:
            self.policy.on_kv_events(worker_id, events, at_s)

    def _first_token(self, worker_id: WorkerId, first: FirstToken, at_s: float) -> None:
        self.flights[first.request_id].first_token = first
        self.ledger.record_first_token(first.request_id)
        self.policy.on_first_token(
            FirstTokenSeen(first.request_id, worker_id, first.ttft_s, first.cached_tokens, at_s)
        )

    def _finished(self, worker_id: WorkerId, done: Finished, at_s: float) -> None:
        flight = self.flights.pop(done.request_id)
        self._record(flight, "served", **_served_outcome(flight, done))
        self.ledger.record_finished(done.request_id)
        e2e_s = done.time_s - done.arrival_s
        seen = FinishedSeen(done.request_id, worker_id, done.output_tokens, e2e_s, at_s,
                            decode_step_s=done.decode_step_s)  # fmt: skip
        self.policy.on_finished(seen)


def _progress_bar(enabled: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )


def _single_model(fleet: FleetSpec, model: str | None) -> ModelName:
    if model is not None:
        if not fleet.engines_for(model):
            raise ValueError(f"no engine of fleet {fleet.name!r} serves model {model!r}")
        return ModelName(model)
    models = fleet.models()
    if len(models) != 1:
        raise ValueError(f"fleet {fleet.name!r} serves {len(models)} models; name one")
    return models[0]


def replay(
    trace: Sequence[TraceRequest],
    fleet: FleetSpec,
    policy: RoutingPolicy,
    *,
    speedup: float = 1.0,
    progress: bool = True,
    limit: int | None = None,
    model: str | None = None,
    step_by_step: bool = False,
    engine_factory: Callable[..., EngineModel] = EngineModel,
    engines_out: dict[WorkerId, EngineModel] | None = None,
) -> QueuePrediction:
    """Replay ``trace`` (its first ``limit`` requests, arrivals divided by ``speedup``)
    on ``fleet`` in virtual time, routing with ``policy``. Every request is for ``model``
    (default: the fleet's only model). At each arrival the policy decides with the
    replay's own :class:`~foretoken.sim.policy.FleetLedger` as its view. ``step_by_step`` turns
    decode runs off (same records, slower: for checking that they are equivalent).
    ``engine_factory`` builds each engine (an instrumented subclass of
    :class:`~foretoken.sim.engine.EngineModel`, for grading); ``engines_out`` receives them."""
    if not (speedup > 0 and math.isfinite(speedup)):
        raise ValueError(f"speedup must be a positive finite number, got {speedup}")
    requests = sorted(trace[:limit] if limit is not None else trace, key=lambda r: r.arrival_s)
    model_name = _single_model(fleet, model)
    state = _Replay(requests, fleet, policy, model_name, speedup, decode_runs=not step_by_step,
                    engine_factory=engine_factory)  # fmt: skip
    if engines_out is not None:
        engines_out.update(state.engines)
    started = time.perf_counter()
    with _progress_bar(progress) as bar:
        state.run(bar)
    records = tuple(record for record in state.records if record is not None)
    if len(records) != len(requests):
        raise RuntimeError(f"{len(requests) - len(records)} requests never completed")
    return QueuePrediction(
        records=records,
        fleet=fleet.name,
        policy=policy.name,
        speedup=speedup,
        wall_s=time.perf_counter() - started,
        virtual_s=state.now_s,
        engine_steps=state.steps,
    )


# ---------------------------------------------------------------------------- summary


def _percentile_values(values: Sequence[float]) -> list[float | None]:
    if not values:
        return [None] * len(PERCENTILES)
    return [float(v) for v in np.percentile(np.asarray(values), PERCENTILES)]


def _met_bound(record: Graded) -> bool:
    bound, actual = record.max_queue_wait_s, record.actual_ttft_s
    return actual is not None and (bound is None or actual <= bound)


def summary(records: Sequence[Graded]) -> dict[str, Any]:
    """Counts, TTFT tails, goodput (served within the bound; no bound = met), the engines'
    cache hit rate (engine-reported cached tokens / prompt tokens, served requests) and
    served requests per worker."""
    served = [r for r in records if r.status == "served"]
    ttft = [r.actual_ttft_s for r in served if r.actual_ttft_s is not None]
    p50, p95, p99 = _percentile_values(ttft)
    prompt = sum(r.prompt_tokens for r in served)
    cached = sum(r.engine_cached_tokens or 0 for r in served)
    goodput = sum(_met_bound(r) for r in served)
    per_worker: dict[str, int] = {}
    for record in served:
        per_worker[record.worker_id or ""] = per_worker.get(record.worker_id or "", 0) + 1
    return {
        "requests": len(records),
        "served": len(served),
        "rejected": sum(r.status == "rejected" for r in records),
        "errors": sum(r.status == "error" for r in records),
        "ttft_p50_s": p50,
        "ttft_p95_s": p95,
        "ttft_p99_s": p99,
        "goodput": goodput,
        "goodput_fraction": goodput / len(records) if records else None,
        "cache_hit_rate": cached / prompt if prompt else None,
        "per_worker": dict(sorted(per_worker.items())),
    }


# ---------------------------------------------------------------------------- what-if


def reused_prefix_tokens(trace: Sequence[TraceRequest]) -> np.ndarray:
    """Per request (in the given order), the tokens of its leading whole segments that an
    earlier request of the trace already had (an unbounded cache shared by everyone)."""
    seen: set[int] = set()
    reused = np.zeros(len(trace), dtype=np.int64)
    for index, request in enumerate(trace):
        chain, matching = 0, True
        for key, length in zip(request.segment_keys, request.segment_lengths, strict=True):
            chain = hash((chain, key, length))
            if matching and chain in seen:
                reused[index] += length
            else:
                matching = False
                seen.add(chain)
        reused[index] = min(int(reused[index]), request.prompt_tokens - 1)
    return reused


def capacity_speedup(
    trace: Sequence[TraceRequest],
    fleet: FleetSpec,
    *,
    model: str | None = None,
    reuse_prefixes: bool = True,
) -> float:
    """The speedup at which the trace's offered prefill work equals the fleet's capacity.

    An operator's what-if tool: it reads every engine's *hidden truth* (its true curve
    ``C(N) = a·N + b·N²``), which routing and prediction never may. A request costs an
    engine ``C(N) − C(K)``, K = its prefix seen earlier in the trace (with
    ``reuse_prefixes``; else 0); an engine then serves ``1 / mean cost`` requests a
    second, the fleet the sum of that over the model's engines, while the trace offers
    ``len(trace) / its duration`` at speedup 1. Decode, step overheads and finite caches
    are left out, so the fleet saturates somewhat *before* this speedup."""
    engines = fleet.engines_for(_single_model(fleet, model))
    arrivals = np.asarray([r.arrival_s for r in trace], dtype=np.float64)
    duration_s = float(arrivals.max() - arrivals.min()) if len(trace) else 0.0
    if not len(trace):
        raise ValueError("the trace has no request this fleet can serve (it is empty, or "
                         "every prompt is bigger than every engine's KV capacity)")  # fmt: skip
    if duration_s <= 0:
        raise ValueError(f"a capacity estimate needs a trace spanning some time: its "
                         f"{len(trace)} requests all arrive at once")  # fmt: skip
    prompt = np.asarray([r.prompt_tokens for r in trace], dtype=np.float64)
    cached = reused_prefix_tokens(trace).astype(np.float64) if reuse_prefixes else 0.0 * prompt
    capacity_rps = 0.0
    for spec in engines:
        a, b = spec.truth.prefill_a_s_per_token, spec.truth.prefill_b_s_per_token2
        mean_cost_s = float(np.mean(a * (prompt - cached) + b * (prompt**2 - cached**2)))
        capacity_rps += 1.0 / mean_cost_s
    return capacity_rps * duration_s / len(trace)


# ---------------------------------------------------------------------------- one call

TRACE_LOADERS: dict[str, Callable[..., list[TraceRequest]]] = {
    "mooncake": load_mooncake,
    "azure-conv": lambda **kw: load_azure(default_trace_path(AZURE_CONV_FILE), **kw),
    "azure-code": lambda **kw: load_azure(default_trace_path(AZURE_CODE_FILE), **kw),
}


def run_replay(
    *,
    fleet: str | Path = "hetero",
    trace: str = "mooncake",
    policy: str = "round-robin",
    speedup: float | None = None,
    capacity_factor: float | None = None,
    limit: int | None = None,
    out_dir: str | Path | None = None,
    seed: int = 0,
    progress: bool = True,
) -> QueuePrediction:
    """Load a fleet (file or shipped name) and a shipped trace (``TRACE_LOADERS``), replay
    it with a registered policy and, with ``out_dir``, append the records to the lake.

    The speedup is ``speedup`` (default 1), or ``capacity_factor`` × :func:`capacity_speedup`
    of the (limited) trace — e.g. 1.0 and 1.5 for "at" and "50% over" capacity."""
    if speedup is not None and capacity_factor is not None:
        raise ValueError("give speedup or capacity_factor, not both")
    if trace not in TRACE_LOADERS:
        raise ValueError(f"unknown trace {trace!r}; known: {', '.join(TRACE_LOADERS)}")
    fleet_spec = load_fleet(fleet)
    requests = TRACE_LOADERS[trace](limit=limit)
    if capacity_factor is not None:
        speedup = capacity_factor * capacity_speedup(requests, fleet_spec)
    chosen = make_policy(policy, FleetLedger.for_fleet(fleet_spec), seed=seed)
    result = replay(requests, fleet_spec, chosen, speedup=speedup or 1.0, progress=progress)
    if out_dir is not None:
        write_lake(result.records, out_dir)
    return result
