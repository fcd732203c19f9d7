"""The processor's state: everything the Faust application keeps in memory, and the handlers
its agents call (decode-or-dead-letter first, in :mod:`foretoken.adapters.kafka.dispatch`).

"The processor" is foretoken's stream-processing process (``foretoken worker``: a Faust
application); "a worker" is always an engine replica. The processor's core (index, fits,
route service, latency controls, grading join) is built by :mod:`foretoken.compose`, exactly
as the virtual-time replay builds it; this module only adds what is Kafka's: offsets (the
index keeper), held acks, the lake sink, metrics, the registrations' endpoints.

Its role (``worker.role``): the **primary** grades (grants + outcomes through the join),
while a **route** replica keeps the same index, fits and queue models and only answers
``/v1/route``: its grants and outcomes go to the route service alone, and it learns cold
samples from the primary's ``graded`` records (read-only) instead of running a join of its
own — one join, one source of truth for what was graded, and no per-request join state on
the replicas (docs/ARCHITECTURE.md "Scale-out").
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from collections import deque
from typing import Any, TypeVar

import msgspec
import numpy as np

from foretoken import __version__
from foretoken.adapters.http.route_page import answer_route
from foretoken.adapters.kafka.dispatch import Dispatcher, Position
from foretoken.adapters.kafka.held_acks import HeldAcks
from foretoken.adapters.kafka.index_keeper import IndexKeeper
from foretoken.adapters.kafka.lag import LagTracker
from foretoken.adapters.kafka.lake_sink import LakeSink
from foretoken.adapters.kafka.members import ALIVE_INTERVALS, MembersView
from foretoken.adapters.kafka.metrics import ProcessorMetrics
from foretoken.compose import ProcessorCore, approx_config, build_core
from foretoken.core.types import WorkerId
from foretoken.settings import Settings
from foretoken.wire.partitioning import model_partition
from foretoken.wire.records import (
    ControlEvent,
    Graded,
    Grant,
    KvEventBatch,
    Member,
    Outcome,
    Record,
    WorkerRegistration,
    as_record,
)
from foretoken.wire.route_rpc import RouteRequest

LAG_TOPICS = ("workers", "kv_events", "grants", "outcomes", "graded")
STALENESS_MEMORY = 4096  # recent staleness samples kept for /v1/stats percentiles
# Clocks of the router, the engines and this process may differ by this much.
MAX_CLOCK_AHEAD_S = 5.0
R = TypeVar("R", KvEventBatch, Grant, Outcome)


class ProcessorState:
    def __init__(self, settings: Settings, index: IndexKeeper | None = None) -> None:
        self.settings = settings
        self.role = settings.worker.role
        self.grading = self.role == "primary"
        self.sharded = settings.sharding == "model"
        self.dispatcher = Dispatcher()
        self.metrics = ProcessorMetrics()
        self.started_ts = time.time()
        self.lag = LagTracker({settings.topic(t): t for t in LAG_TOPICS},
                              settings.worker.ready_lag_records,
                              settings.worker.lagging_after_s,
                              exact=frozenset({"workers"}))  # fmt: skip
        self.members = MembersView(ALIVE_INTERVALS * settings.worker.member_interval_s)
        # The partitions of the input topics Kafka assigned us (co-partitioned).
        self.owned: set[int] = set(range(settings.layout.partitions))
        # (when, seconds) from another replica's decision to its grant in our queue model,
        # once caught up (a replay of old grants is catching up, not staleness).
        self.staleness: deque[tuple[float, float]] = deque(maxlen=STALENESS_MEMORY)
        # (when, seconds) from an outcome (a first token, a completion: the router's clock)
        # to its application here: how old the queue model's picture of a worker is.
        self.outcome_delay: deque[tuple[float, float]] = deque(maxlen=STALENESS_MEMORY)
        self.routes_answered = 0
        self.forwarded = 0
        self.future_ts = 0  # records stamped ahead of this clock (clamped: _not_ahead)
        self.dead_letter_failures = 0  # dead letters the broker would not take (logged)
        approx = approx_config(settings)
        self.index = index or IndexKeeper(
            settings.topic("kv_events"), None, approx=approx, config=settings.index
        )
        self.index.approx = approx
        self.core: ProcessorCore = build_core(settings, index=self.index.index)
        self.controls = self.core.controls
        # Registrations as they came: the engines' endpoints (the route page's URLs).
        self.registrations: dict[WorkerId, WorkerRegistration] = {}
        # Grants/outcomes are acked only once the join has settled their request.
        self.held_acks = HeldAcks(lambda: self.core.join.pending)
        # The graded -> Parquet lake sink, when a lake directory is configured.
        self.lake = (LakeSink(settings.lake, self.metrics.registry)
                     if settings.lake.dir and self.grading else None)  # fmt: skip
        self.dispatcher.on_tombstone("workers", self.retired)
        self.dispatcher.on("workers", self.on_worker)
        self.dispatcher.on("workers", self.index.on_worker)
        self.dispatcher.on("kv_events", self.index.on_kv)
        self.dispatcher.on("kv_events", self.on_kv)
        self.dispatcher.on("grants", self.on_grant)
        self.dispatcher.on("outcomes", self.on_outcome)
        self.dispatcher.on("graded", self.on_graded)

    @property
    def fits(self) -> Any:
        return self.core.service.fits

    @property
    def outputs(self) -> Any:
        return self.core.service.outputs

    def retired(self, key: bytes) -> WorkerRegistration | None:
        """A ``workers`` tombstone (the topic is compacted, keyed by worker id): the worker's
        last registration, marked removed; None for a worker this process never saw."""
        reg = self.registrations.get(WorkerId(key.decode("utf-8", "replace")))
        return None if reg is None else msgspec.structs.replace(reg, removed=True)

    def on_worker(self, record: Record, pos: Position) -> None:
        assert isinstance(record, WorkerRegistration)
        if record.removed:
            self.registrations.pop(record.worker_id, None)
        else:
            self.registrations[record.worker_id] = record
        self.core.register(record, index=False)  # the index keeper files it in the index

    def _not_ahead(self, record: R, now: float) -> R:
        """A record's time no later than ``now`` + MAX_CLOCK_AHEAD_S: one stamped in the
        future (a broken clock, or a stranger's record) would otherwise hold its queue entry
        — and every prediction on that worker — until the clock caught up (a day ahead: a
        day of 86,400-s predictions). Clamped to now and counted."""
        if record.ts <= now + MAX_CLOCK_AHEAD_S:
            return record
        self.future_ts += 1
        return msgspec.structs.replace(record, ts=now)

    def on_kv(self, record: Record, pos: Position) -> None:
        """After the index: a lone prompt's stores time its prefill (core.routing.kv_progress)."""
        assert isinstance(record, KvEventBatch)
        now = time.time()
        self.core.service.on_kv_batch(self._not_ahead(record, now), now)

    def on_grant(self, record: Record, pos: Position) -> list[tuple[str, Record]]:
        assert isinstance(record, Grant)
        now = time.time()
        record = self._not_ahead(record, now)
        if (not record.fallback and self.lag.caught_up_at is not None
                and record.request_id not in self.core.service.decisions):  # fmt: skip
            # decided elsewhere: how long it took to reach our queue model
            self.staleness.append((now, max(0.0, now - record.ts)))
            self.metrics.staleness.observe(max(0.0, now - record.ts))
        if not self.grading:
            self.core.service.on_grant(record, now)
            return []
        return _graded(self.core.on_grant(record, now))

    def on_outcome(self, record: Record, pos: Position) -> list[tuple[str, Record]]:
        assert isinstance(record, Outcome)
        now = time.time()
        record = self._not_ahead(record, now)
        if self.lag.caught_up_at is not None:
            delay = max(0.0, now - record.ts)
            self.outcome_delay.append((now, delay))
            self.metrics.outcome_delay.observe(delay)
        if not self.grading:
            self.core.service.on_outcome(record, now)
            return []
        return _graded(self.core.on_outcome(record, now))

    def on_graded(self, record: Record, pos: Position) -> None:
        assert isinstance(record, Graded)
        self.core.on_graded(record, time.time())

    def route(self, request: RouteRequest) -> bytes:
        """``POST /v1/route``: the decision, reflected at once in the queue model."""
        self.routes_answered += 1
        return answer_route(self.core, self.registrations, request, time.time())

    def owns(self, model: str) -> bool:
        """Whether this process answers for ``model`` (always, unless it is a route instance
        sharded by model that was not assigned the model's partition)."""
        if not self.sharded or self.role != "route":
            return True
        return model_partition(model, self.settings.layout.partitions) in self.owned

    def owner_of(self, model: str) -> Member | None:
        """The ready route instance that owns ``model`` (from the members topic)."""
        return self.members.owner(model, self.settings.layout.partitions, time.time(),
                                  self.settings.group_id)  # fmt: skip

    def expire(self) -> list[Graded]:
        if not self.grading:
            self.core.service.maintain(time.time())
            return []
        return [as_record(Graded, g) for g in self.core.expire(time.time())]

    def refresh_share(self) -> None:
        """This replica's share of near-ties, from the route replicas alive and ready."""
        if self.role != "route" or self.sharded:
            return
        prefix = f"{self.settings.worker.app_id}-route-"
        share = self.members.share(self.settings.instance_id, prefix, time.time())
        self.core.service.decider.share = share

    def member(self, *, removed: bool = False) -> Member:
        now = time.time()
        return Member(
            instance_id=self.settings.instance_id, role=self.role,
            url=self.settings.advertise_url, group=self.settings.group_id,
            sharding=self.settings.sharding, partitions=tuple(sorted(self.owned)),
            ready=self.lag.readiness(now) == "ok" and not removed,
            models=tuple(sorted(self.index_models())), ts=now, removed=removed,
        )  # fmt: skip

    def index_models(self) -> set[str]:
        return {str(w["model"]) for w in self.index.index.stats()["workers"].values()}  # type: ignore[attr-defined]

    def health(self) -> tuple[int, dict[str, Any]]:
        """``/healthz``: a route replica is 200 only when ready; the primary always."""
        now = time.time()
        body: dict[str, Any] = {"version": __version__, "role": self.role,
                                "instance_id": self.settings.instance_id,
                                **self.lag.describe(now)}  # fmt: skip
        if self.grading:
            body["caught_up"] = body["status"] == "ok"
            body["status"] = "ok"
            return 200, body
        return (200 if body["status"] == "ok" else 503), body

    def control_events(self) -> list[ControlEvent]:
        """Evaluate the latency controls now; their stage changes, for the ``controls``
        topic (and the metrics)."""
        controls = self.controls
        if controls is None:
            return []
        now = time.time()
        controls.tick(now)
        events = [as_record(ControlEvent, e) for e in controls.drain()]
        self.metrics.observe_controls(controls.snapshot(now), events)
        return events

    def effective_config(self) -> dict[str, Any]:
        """The configuration the running parts use (read from them, not from the settings
        object): ``/v1/config``."""
        service = self.core.service
        return msgspec.to_builtins({
            "predictor": service.config,
            "fits": service.fits.config,
            "join": {"timeout_s": self.core.join.timeout_s,
                     "expiry_interval_s": self.core.join_config.expiry_interval_s,
                     "graded_memory": self.core.join.graded_memory},
            "controls": self.controls.settings if self.controls is not None else None,
            "approx": self.index.approx,
            "index_backend": self.index.index.backend,
            "index": self.index.config,
        })  # fmt: skip

    def stats(self) -> dict[str, Any]:
        now = time.time()
        service = self.core.service
        share = service.decider.share
        return {
            "version": __version__,
            "role": self.role,
            "instance_id": self.settings.instance_id,
            "group": self.settings.group_id,
            "uptime_s": round(now - self.started_ts, 3),
            "consumed": dict(self.dispatcher.counts),
            "dead_lettered": dict(self.dispatcher.dead),
            "join": dataclasses.asdict(self.core.join.counters) if self.grading else None,
            "index_snapshots": self.index.snapshots,
            "restored_from_snapshot": self.index.restored_from,
            "lake": self.lake.stats() if self.lake is not None else None,
            "controls": self.controls.snapshot(now) if self.controls else None,
            "readiness": self.lag.describe(now),
            "routes_answered": self.routes_answered,
            "forwarded": self.forwarded,
            "replica_share": None if share is None else [share.index, share.count],
            "share_moves": service.decider.share_moves,
            "overruled_decisions": service.overruled,
            "grants_for_unknown_workers": service.unknown_worker_grants,
            "failed_predictions": service.predictions.failures,
            "unreachable_workers": service.predictions.health.stats(time.time()),
            "last_failed_prediction": dict(service.predictions.last_failure),
            "future_ts_clamped": self.future_ts,
            "dead_letter_failures": self.dead_letter_failures,
            "kv_step_samples": service.learner.kv_steps.samples,
            "queue_view_staleness_s": self.staleness_since(0.0),
            "outcome_delay_s": _percentiles([v for _, v in self.outcome_delay]),
            "members": self.members_page(now),
            "memory": self.memory(),
        }

    def staleness_since(self, since_ts: float) -> dict[str, float | int | None]:
        """Percentiles of the queue-view staleness samples taken since ``since_ts``."""
        return _percentiles([v for t, v in self.staleness if t >= since_ts])

    def members_page(self, now: float) -> list[dict[str, Any]]:
        """The processors alive on the members topic, as this one sees them."""
        return [
            {"instance_id": m.instance_id, "role": m.role, "url": m.url, "ready": m.ready,
             "partitions": list(m.partitions), "age_s": round(now - m.ts, 3)}
            for m in self.members.alive(now)
        ]  # fmt: skip

    def memory(self) -> dict[str, Any]:
        """What this process holds (its memory says so): RSS, the index per model, requests
        in the queue models and in the join."""
        stats = self.index.index.stats()
        per_model: dict[str, dict[str, int]] = {}
        for w in stats["workers"].values():  # type: ignore[attr-defined]
            entry = per_model.setdefault(str(w["model"]), {"workers": 0, "blocks": 0})
            entry["workers"] += 1
            entry["blocks"] += sum(w["blocks"].values())
        book = self.core.service.book
        return {
            "rss_bytes": _rss_bytes(),
            "index_models": per_model,
            "index_blocks": sum(m["blocks"] for m in per_model.values()),
            "queue_requests": sum(q.outstanding_count for q in book.queues.values()),
            "join_pending": len(self.core.join.pending),
            "decisions_remembered": len(self.core.service.decisions),
            # objects moved out of the collector's passes after start (adapters/heap.py)
            "gc_frozen_objects": gc.get_freeze_count(),
        }


def _graded(records: list[Any]) -> list[tuple[str, Record]]:
    return [("graded", as_record(Graded, g)) for g in records]


def _percentiles(values: Any) -> dict[str, float | int | None]:
    if not values:
        return {"samples": 0, "p50": None, "p90": None, "p99": None}
    arr = np.fromiter(values, dtype=float)
    p50, p90, p99 = (round(float(v), 4) for v in np.percentile(arr, (50, 90, 99)))
    return {"samples": int(arr.size), "p50": p50, "p90": p90, "p99": p99}


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
